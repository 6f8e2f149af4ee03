#!/usr/bin/env bash
# The test command: sets up .venv (the dev, spark, crypto, agent and sources extras), then lint, type check and the whole test suite,
# Spark tests included (they need Java 17+), then the fast tests again on the pure-Python path. With arguments,
# runs pytest with them instead
# (e.g. scripts/test.sh -m "not spark" for a fast run).
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev,spark,crypto,agent,sources
if [ $# -eq 0 ]; then
  # The Spark run needs Java 17+: say so now, in one line, not after the long non-Spark run.
  if ! problem="$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests")
from spark_session import java_problem
p = java_problem()
print(p or "")
sys.exit(1 if p else 0)')"; then
    echo "scripts/test.sh: ${problem:-cannot check Java}" >&2
    exit 2
  fi
fi
.venv/bin/ruff check filechannel tests bench examples
.venv/bin/ruff format --check filechannel tests bench examples
.venv/bin/mypy
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
# The real clients of the tests (logger, rsyslog with RELP, tmux), installed when missing and possible.
bash scripts/clients.sh
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# The whole suite selects its own tests. Options or plugins from the environment could deselect some
# of them (PYTEST_ADDOPTS='-k "not spark"' drops every Spark test: -k matches marker names too), so
# they are not passed on, and this says so.
for var in PYTEST_ADDOPTS PYTEST_PLUGINS; do
  if [ -n "${!var:-}" ]; then
    echo "scripts/test.sh: ignoring $var=${!var} (the full suite runs every test; pass pytest arguments to choose)" >&2
    unset "$var"
  fi
done
# The whole suite in two runs: everything but Spark, then the Spark tests (one JVM). Each run names
# its marker expression on the command line; pytest fails the second run if it selects no test at all.
# The Spark run includes the soak: `python -m bench.soak --minutes 3 --seed 1` (tests/test_soak.py:
# three agents, every write path, a Spark cluster, every fault kind; lost 0, duplicated 0).
.venv/bin/python -m pytest -m "not spark"
.venv/bin/python -m pytest -m spark
# The pure-Python twin of the C accelerator (issue 14): the non-Spark, non-slow tests once more with
# FILECHANNEL_PURE_PYTHON=1 (tests/test_speedups.py, which compares the two paths, skips there).
# Skipped, and said so, only when the accelerator was not built (then the runs above were pure already).
# Its skips are the tests that compare the two paths (no C twin here): counted in its summary line, not
# listed one by one (-r fE lists failures and errors only).
if .venv/bin/python -c "import sys; from filechannel import format as f; sys.exit(f.speedups is None)"; then
  echo "scripts/test.sh: the fast tests again on the pure-Python path (FILECHANNEL_PURE_PYTHON=1); the tests" \
    "comparing it with the C accelerator skip there" >&2
  FILECHANNEL_PURE_PYTHON=1 .venv/bin/python -m pytest -m "not spark and not slow" -p no:cacheprovider -r fE
else
  echo "scripts/test.sh: the C accelerator is not built; the runs above covered the pure-Python path" >&2
fi
