#!/usr/bin/env bash
# The docker sandbox backend (envs/sandbox/docker.py): the Docker daemon, and the base image the
# shipped and test task images build FROM. No registry is reachable here, so debian:bookworm-slim
# is built locally from Debian packages (mmdebstrap minbase, ~20-40 s) and imported; `docker build`
# then runs each Dockerfile's `RUN apt-get install` against the Debian mirror. Starts dockerd if
# none answers (.ci/run starts it too). Idempotent: installs and imports only what is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v dockerd >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq docker.io mmdebstrap >/dev/null
fi
bash "$(dirname "$0")/../start-dockerd"
if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    mmdebstrap --quiet --variant=minbase bookworm - | docker import - debian:bookworm-slim >/dev/null
fi
# The terminal domain's image (envs/images/terminal.Dockerfile), tagged as envs/sandbox/docker.py's
# ensure_image names it (a hash of the Dockerfile), so the test session finds it built (~40 s once).
images="$(cd "$(dirname "$0")/../../envs/images" && pwd)"
tag="jointrl-terminal:$(sha256sum "$images/terminal.Dockerfile" | cut -c1-16)"
if ! docker image inspect "$tag" >/dev/null 2>&1; then
    docker build -q -t "$tag" -f "$images/terminal.Dockerfile" "$images" >/dev/null
fi
