#!/usr/bin/env bash
# The browser domain (envs/browser/): Debian's Chromium for image mode, and a read-only tool venv
# that the episode's sandbox mounts at the same path (SandboxConfig.tool_mounts). The venv runs on
# Debian's /usr/bin/python3 (the only Python inside the sandbox) and holds the page driver's
# libraries: markdownify (HTML -> markdown, with BeautifulSoup) and Playwright (its Node driver
# ships in the wheel; `playwright install` is never run: it drives /usr/bin/chromium).
# Idempotent: installs only what is missing.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
VENV="${JOINTRL_BROWSER_VENV:-/opt/jointrl/venvs/browser}"
if ! command -v chromium >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
if ! /usr/bin/python3 -m venv --help >/dev/null 2>&1 || ! /usr/bin/python3 -c "import ensurepip" >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=900 update -qq
    apt-get -o DPkg::Lock::Timeout=900 install -y -qq python3-venv >/dev/null
fi
if ! "$VENV/bin/python" -c "import markdownify, bs4, playwright.sync_api" >/dev/null 2>&1; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
        "markdownify>=0.13,<2" "beautifulsoup4>=4.12,<5" "playwright>=1.45,<2"
fi
chmod -R a+rX "$VENV"  # the sandbox's leased uid reads it
