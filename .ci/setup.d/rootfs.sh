#!/usr/bin/env bash
# A Debian rootfs for the sandbox's system (envs.sandbox.rootfs=DIR, envs/sandbox/rootfs.py):
# what the terminal and code_repo verifiers and oracle solutions run, so a cluster whose nodes
# lack gcc / git / pytest can run those domains from one directory built once, without root on
# the nodes. mmdebstrap's minbase (Essential + apt) plus the tools the shipped tasks call.
# Idempotent: a rootfs whose stamp names the same package list is kept as is.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
DEST="${JOINTRL_ROOTFS:-/opt/jointrl/rootfs/bookworm-tools}"
SUITE="${JOINTRL_ROOTFS_SUITE:-bookworm}"
PKGS="bash,coreutils,python3,python3-pytest,git,gcc,libc6-dev,make,sqlite3,jq"
STAMP="$DEST/.jointrl-rootfs"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SUITE $PKGS" ]; then
    exit 0
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends mmdebstrap >/dev/null
fi
rm -rf "$DEST.new"
mkdir -p "$(dirname "$DEST")"
# Docs, man pages, locales and apt's lists are dropped: the sandbox only runs the binaries.
mmdebstrap --quiet --variant=minbase --include="$PKGS" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$SUITE" "$DEST.new"
chmod a+rx "$DEST.new"  # the sandbox runs as any uid: the tree must be world-readable (Debian's modes are)
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
echo "$SUITE $PKGS" > "$STAMP"
