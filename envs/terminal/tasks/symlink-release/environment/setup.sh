mkdir -p releases/v1 releases/v2 && echo v1 > releases/v1/VERSION && echo v2 > releases/v2/VERSION && ln -s releases/v1 current
