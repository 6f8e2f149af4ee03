#!/usr/bin/env bash
# Create (or reuse) .venv and install filechannel with the given extras.
# Usage: source scripts/venv.sh [extras]   (extras default: dev)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-dev}"
py="${PYTHON:-python3}"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv"
fi
stamp="$root/.venv/.installed-$extras"
if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ]; then
  "$root/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[$extras]"
  touch "$stamp"
fi
