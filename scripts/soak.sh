#!/usr/bin/env bash
# The soak (issue 36): three writable agents with mutual TLS, producers on HTTP, Flight and tailed files,
# a Spark standalone cluster reading through the agents into Parquet, and a fault schedule drawn from the
# seed (kills and stops of agents, driver, executor and producers; delay, cuts and a black hole between
# Spark and the agents; a full disk where the channel supports it). Prints one JSON summary and writes
# a PNG (throughput per path, faults marked). Needs Java 17+. Sets up .venv (dev, spark, crypto, agent, bench).
# Usage: scripts/soak.sh [--minutes N] [--seed S] [--workdir DIR] [--png FILE] [--disk-fault auto|on|off]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/venv.sh dev,spark,crypto,agent,bench
exec .venv/bin/python -m bench.soak "$@"
