#!/usr/bin/env bash
# The office domain (envs/office/): LibreOffice Calc (headless; it recalculates spreadsheet
# formulas; python3-uno lets envs/office/recalc.py keep one warm per env worker) and a read-only tool venv that the episode's sandbox mounts at the same path
# (SandboxConfig.tool_mounts). The venv runs on Debian's /usr/bin/python3 (the only Python inside
# the sandbox) and holds openpyxl, python-docx and python-pptx, which envs/office/tool/office_tool.py
# uses. Idempotent: installs only what is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
VENV="${JOINTRL_OFFICE_VENV:-/opt/jointrl/venvs/office}"
if ! command -v soffice >/dev/null 2>&1 || ! /usr/bin/python3 -c "import uno" >/dev/null 2>&1; then
    # python3-uno: envs/office/recalc.py's warm LibreOffice, driven over UNO from Debian's Python
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends libreoffice-calc-nogui python3-uno >/dev/null
fi
if ! /usr/bin/python3 -c "import ensurepip" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq python3-venv >/dev/null
fi
if ! "$VENV/bin/python" -c "import openpyxl, docx, pptx" >/dev/null 2>&1; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "openpyxl==3.1.5" "python-docx==1.1.2" "python-pptx==1.0.2"
fi
chmod -R a+rX "$VENV"  # the sandbox's leased uid reads it
