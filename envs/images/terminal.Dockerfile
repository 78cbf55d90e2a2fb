# The terminal domain's image for the docker sandbox backend (envs/sandbox/docker.py): the
# tools the shipped terminal tasks use, and an unprivileged user (uid 1000) that runs every
# command. The container's root filesystem is mounted read-only; /work and /tmp are tmpfs.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash coreutils findutils grep sed gawk diffutils \
      git gcc libc6-dev make python3 sqlite3 jq procps file tar gzip ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 1000 --create-home --shell /bin/bash agent
WORKDIR /work
CMD ["sleep", "infinity"]
