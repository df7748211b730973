#!/usr/bin/env bash
# System packages the tests need: Debian's chromium for the dashboard's browser test (Playwright drives it at
# /usr/bin/chromium; `playwright install` is never used). Installed only where missing, and only where apt-get can
# (root on Debian); elsewhere a note, and the browser test says what it lacks.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  echo "install_system: installing chromium (Debian) for the dashboard's browser test"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
else
  echo "install_system: no /usr/bin/chromium and no root apt-get here: install Debian's chromium for the browser test" >&2
fi
