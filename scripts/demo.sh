#!/usr/bin/env bash
# The main job, end to end: a producer and a consumer through a real channel
# directory, with a kill -9 of the producer and a recovery in the middle.
# Usage: scripts/demo.sh [channel-dir]   (default: ./demo-channel, wiped first)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev
exec .venv/bin/python examples/demo.py "${1:-$root/demo-channel}"
