#!/usr/bin/env bash
# The test command: sets up .venv (the dev and spark extras), then lint, type check and the whole test suite
# (the Spark tests need Java 17+; deselect them with -m "not spark").
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev,spark
.venv/bin/ruff check filechannel tests bench examples
.venv/bin/ruff format --check filechannel tests bench examples
.venv/bin/mypy
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
.venv/bin/python -m pytest "$@"
