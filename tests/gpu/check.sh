#!/usr/bin/env bash
# The prepared GPU check, for the lent machine (one H200, its own Python and torch, no Ray, DeepSpeed,
# Hydra or network; at most 64 MiB of code and wheels per run). Two parts, each under 235 s:
#   1. kernels: every Triton kernel against its torch reference at production shapes (the engine's paged
#      decode and prefill attention included), MXFP4 quantize and the decode MoE matmul as shares of
#      measured copy bandwidth (targets >= 70 % / >= 50 %) (tests/bench/bench_kernels.py), then
#      `pytest -m gpu tests/gpu` where pytest is installed (the compiled prefill kernel among them);
#   2. engine: the own engine on the triton kernel backend vs HF generate, with decode graphs on vs off
#      (tokens equal), and one colocated step
#      (tests/gpu/check_engine.py).
# Usage: tests/gpu/check.sh [--dry] [--wheels DIR]
#   --dry         the same code on the host: Triton interpreted, tiny shapes (tests/gpu/test_check.py runs it)
#   --wheels DIR  install DIR/*.whl (e.g. xxhash, transformers) offline into a temporary folder first
# Exit status: 0 when both parts passed, else the first failing part's.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dry=""
wheels=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) dry="--dry" ;;
        --wheels) shift; wheels="${1:?--wheels needs a folder}" ;;
        *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
python="${PYTHON:-python3}"
# `import jointrl` resolves to this checkout through a symlink in a temporary folder (the repository root is
# the package); the folder is removed file by file on exit, never with a recursive delete.
tmp="$(mktemp -d)" || exit 1
cleanup() {
    rm -f "$tmp/jointrl"
    if [ -d "$tmp/site" ]; then "$python" -c 'import shutil, sys; shutil.rmtree(sys.argv[1])' "$tmp/site"; fi
    rmdir "$tmp"
}
trap cleanup EXIT
ln -s "$repo" "$tmp/jointrl"
export PYTHONPATH="$tmp${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$wheels" ]; then
    "$python" -m pip install --quiet --no-index --no-deps --target "$tmp/site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:$tmp/site"
fi
if [ -n "$dry" ]; then
    export TRITON_INTERPRET=1  # before Python starts: Triton reads it at import
fi
"$python" -c 'import torch, triton, xxhash' || { echo "check.sh: torch, triton and xxhash are needed (--wheels)"; exit 1; }

status=0
echo "== part 1: kernels $dry"
timeout 235 "$python" "$repo/tests/bench/bench_kernels.py" $dry || status=$?
if [ -z "$dry" ] && "$python" -c 'import pytest' 2>/dev/null; then
    (cd "$repo" && timeout 120 "$python" -m pytest -q -m gpu -p no:cacheprovider tests/gpu) || { [ $status -ne 0 ] || status=$?; }
fi
echo "== part 2: engine $dry"
timeout 235 "$python" "$repo/tests/gpu/check_engine.py" $dry || { [ $status -ne 0 ] || status=$?; }
echo "== check.sh: exit $status"
exit $status
