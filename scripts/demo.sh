#!/usr/bin/env bash
# The main job, end to end: a producer process feeds a channel at a steady rate
# (with rollbacks), a Spark Structured Streaming query (local[2]) in its own
# driver process streams it into a Parquet table; the driver and its JVM are
# killed with SIGKILL mid-stream and restarted on the checkpoint, the producer is
# killed and recovered too; a final availableNow run drains the rest; then every
# event is checked: produced N, delivered N, duplicated 0, lost 0.
# Needs Java 17+ (Spark). Sets up .venv with the dev, spark and crypto extras.
# Usage: scripts/demo.sh [WORKDIR] [examples/pipeline.py options]
#        (WORKDIR default: ./demo-work, wiped first if it holds an earlier run; options: --help)
#        scripts/demo.sh --cluster [WORKDIR] [examples/cluster.py options]
#        three "hosts" (a producer, its channel and an agent each, the agents over mutual TLS with a
#        certificate each, an allow-list and a token; --insecure: plain grpc on loopback), a Spark
#        standalone master and worker whose executors cannot see the channel files, kills of an agent,
#        the driver and a producer, the exactly-once check per channel (WORKDIR default: ./demo-cluster)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

help=0
for arg in "$@"; do
  case "$arg" in -h | --help) help=1 ;; esac
done
java="java"
if [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; then
  java="$JAVA_HOME/bin/java"
fi
# `java -version` prints e.g. openjdk version "17.0.15" ..., or java version "1.8.0_392" ...
version="$("$java" -version 2>&1 | sed -n 's/.*version "\([^"]*\)".*/\1/p' | head -n 1 || true)"
major="${version%%[.+-]*}"
if [ "$major" = "1" ]; then
  major="$(echo "$version" | cut -d. -f2)"
fi
case "$major" in
  '' | *[!0-9]*) major=0 ;;
esac
if [ "$major" -lt 17 ] && [ "$help" = 0 ]; then
  echo "filechannel demo: Spark needs Java 17+; install a JDK 17 (e.g. apt install openjdk-17-jre-headless) and run again" >&2
  exit 2
fi

cluster=0
if [ $# -gt 0 ] && [ "$1" = "--cluster" ]; then
  cluster=1
  shift
fi
bash scripts/venv.sh dev,spark,crypto
workdir="$root/demo-work"
if [ "$cluster" = 1 ]; then
  workdir="$root/demo-cluster"
fi
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  workdir="$1"
  shift
fi
if [ "$cluster" = 1 ]; then
  FILECHANNEL_DEMO_PROG="scripts/demo.sh --cluster" exec .venv/bin/python examples/cluster.py "$workdir" "$@"
fi
FILECHANNEL_DEMO_PROG="scripts/demo.sh" exec .venv/bin/python examples/pipeline.py "$workdir" "$@"
