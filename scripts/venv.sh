#!/usr/bin/env bash
# Create (or reuse) .venv and install filechannel with the given extras.
# Usage: bash scripts/venv.sh [extras]   (a comma list, e.g. dev,spark; default: dev)
# One stamp per extra (.venv/.installed-<extra>): a later call asking for any
# subset of what is installed (and no newer setup.cfg, setup.py or C accelerator source) installs
# nothing. The install builds the optional C accelerator in place (setup.py; skipped, with a
# warning, where there is no compiler).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-dev}"
py="${PYTHON:-python3}"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$py" -m venv "$root/.venv"
fi
IFS=',' read -r -a wanted <<<"$extras"
missing=0
for extra in "${wanted[@]}"; do
  stamp="$root/.venv/.installed-$extra"
  if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ] || [ "$root/setup.py" -nt "$stamp" ] \
    || [ "$root/filechannel/_speedups.c" -nt "$stamp" ]; then
    missing=1
  fi
done
if [ "$missing" = 1 ]; then
  "$root/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[$extras]"
  for extra in "${wanted[@]}"; do
    touch "$root/.venv/.installed-$extra"
  done
fi
