# The terminal domain's image for the docker sandbox backend (envs/sandbox/docker.py): the
# tools the shipped terminal tasks use, and an unprivileged user (uid 1000) that runs every
# command in /work (the sandbox mounts a size-bounded tmpfs there). The rest of the image is
# writable only by root, so the agent cannot change it. Base: debian:bookworm-slim (imported
# locally by .ci/setup.d/docker.sh where no registry is reachable).
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends bash coreutils findutils grep sed gawk diffutils \
      git gcc libc6-dev make python3 python3-pytest sqlite3 jq procps file tar gzip ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 1000 --create-home --shell /bin/bash agent && mkdir -p /work && chown agent:agent /work
USER agent
ENV HOME=/work
WORKDIR /work
CMD ["sleep", "infinity"]
