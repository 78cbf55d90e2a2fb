#!/usr/bin/env bash
# The CAD domain (envs/cad/): a read-only tool venv with CadQuery that every CAD sandbox mounts at
# the same path (SandboxConfig.tool_mounts). It runs on Debian's /usr/bin/python3 -- the only
# Python inside the sandbox, 3.11 here, matching the cp311 wheels of cadquery-ocp -- so the venv
# holds CadQuery alone (~1.8 GB with OCP and VTK; it and build123d break each other: we pick
# CadQuery). The host-side reward deps (trimesh, manifold3d, libigl) are pyproject's `cad` extra.
# Idempotent: rebuilds the venv only when CadQuery does not import at the pinned version.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
VENV="${JOINTRL_CAD_VENV:-/opt/jointrl/venvs/cad}"
PINS=("cadquery==2.8.0" "cadquery-ocp==7.9.3.1.1" "vtk==9.6.2" "numpy==2.4.6")
if ! /usr/bin/python3 -c "import ensurepip" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq python3-venv >/dev/null
fi
if ! "$VENV/bin/python" -c "import cadquery, sys; sys.exit(cadquery.__version__ != '2.8.0')" >/dev/null 2>&1; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}"
    chmod -R a+rX "$VENV"  # the sandbox's leased uid reads it
fi
