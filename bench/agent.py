"""The agent's write side (HTTP source, Flight puts) against in-process puts (issue 25).

    .venv/bin/python -m bench.agent [--n N] [--repeats R] [--quick] [--data-dir DIR]

Prints one JSON line per result on stdout and a summary table on stderr.
Workload: transactions of 100 events of 100 B and 1 KiB, ``fsync="commit"``
(one fdatasync per commit, the channel's default), N events per case.

Systems:
- ``put_many (in-process)``: one thread, ``tx.put_many(100 bodies)`` + commit;
- ``http 1 client``: ``filechannel serve --writable --http`` in a child process,
  one keep-alive client posting Flume JSON bodies of 100 events, one at a time;
- ``http 1 client + key``: the same with an ``Idempotency-Key`` per request
  (a mark committed with the events);
- ``http 4 clients + key``: four such clients at once (their commits share fsyncs);
- ``flight put_batch x1000``: exactly-once Flight puts (``AgentClient.put_batch``) of
  1000 events each, one producer, one at a time (against ``put_many`` of 100 per
  transaction in process: the Flight put amortises its round trip over 1000).

Within a repeat the systems run one after the other, each on a fresh channel;
the ratio ``<http system> / put_many`` is taken within the repeat, then
summarised as median and min-max over the repeats.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import filechannel

from .run import bench_start, rate_rows, run_record, spread_cells, table_head

BATCH = 100
SIZES = (100, 1024)
OPTS: dict[str, Any] = {"fsync": "commit", "minimum_required_space": 0, "checkpoint_interval": 0}
ROOT = Path(__file__).resolve().parent.parent


def in_process(directory: str, size: int, n: int) -> dict[str, Any]:
    body = b"x" * size
    with filechannel.open(directory, capacity=max(1_000_000, n), **OPTS) as ch:
        t0 = time.perf_counter()
        for _ in range(n // BATCH):
            with ch.transaction() as tx:
                tx.put_many([body] * BATCH)
        took = time.perf_counter() - t0
    return {"events_per_s": n / took, "seconds": took}


class BenchAgent:
    """``filechannel serve DIR --writable --http 127.0.0.1:0`` (and ``extra`` arguments) in a child process."""

    def __init__(self, directory: str, *extra: str) -> None:
        filechannel.open(directory, **OPTS).close()
        self.hpf = Path(directory + ".http-port")
        pf = Path(directory + ".port")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "filechannel",
                "serve",
                directory,
                "--listen",
                "grpc://127.0.0.1:0",
                "--port-file",
                str(pf),
                "--writable",
                "--http",
                "127.0.0.1:0",
                "--http-port-file",
                str(self.hpf),
                "--log-level",
                "WARNING",
                *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not pf.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the agent exited: {self.proc.communicate()[1]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the agent did not start within 60 s")
            time.sleep(0.05)
        self.port = int(self.hpf.read_text())
        self.flight_port = int(pf.read_text())

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=60)


def _client(port: int, payload: bytes, requests: int, key_prefix: str | None, lat: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        for i in range(requests):
            headers = {"Content-Type": "application/json"}
            if key_prefix is not None:
                headers["Idempotency-Key"] = f"{key_prefix}-{i}"
            t = time.perf_counter()
            conn.request("POST", "/v1/channels/c/events", body=payload, headers=headers)
            r = conn.getresponse()
            r.read()
            lat.append(time.perf_counter() - t)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}")
    finally:
        conn.close()


def over_http(directory: str, size: int, n: int, clients: int, key: bool) -> dict[str, Any]:
    payload = json.dumps([{"body": "x" * size}] * BATCH).encode()
    agent = BenchAgent(directory)
    try:
        per_client = n // BATCH // clients
        lats: list[list[float]] = [[] for _ in range(clients)]
        cpu0 = agent.cpu_seconds()
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=_client, args=(agent.port, payload, per_client, f"c{k}" if key else None, lats[k]))
            for k in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        cpu = agent.cpu_seconds() - cpu0
    finally:
        agent.stop()
    all_lat = sorted(x for lat in lats for x in lat)
    events = per_client * clients * BATCH
    if len(all_lat) != per_client * clients:
        raise RuntimeError("a client failed")
    return {
        "events_per_s": events / took,
        "seconds": took,
        "p50_ms": all_lat[len(all_lat) // 2] * 1000,
        "p99_ms": all_lat[min(len(all_lat) - 1, int(len(all_lat) * 0.99))] * 1000,
        "agent_cpu_us_per_event": cpu / events * 1e6,
    }


FLIGHT_BATCH = 1000


def over_flight(directory: str, size: int, n: int) -> dict[str, Any]:
    """Exactly-once Flight puts (``AgentClient.put_batch``) of 1000 events each, one producer, one at a time."""
    from filechannel.agent import connect

    agent = BenchAgent(directory)
    bodies = [b"x" * size] * FLIGHT_BATCH
    try:
        with connect(f"grpc://127.0.0.1:{agent.flight_port}", timeout=60) as client:
            cid = next(iter(client.channels()))
            lat: list[float] = []
            cpu0 = agent.cpu_seconds()
            t0 = time.perf_counter()
            puts = max(1, n // FLIGHT_BATCH)
            for seq in range(1, puts + 1):
                t = time.perf_counter()
                client.put_batch(cid, bodies, producer="bench", sequence=seq)
                lat.append(time.perf_counter() - t)
            took = time.perf_counter() - t0
            cpu = agent.cpu_seconds() - cpu0
    finally:
        agent.stop()
    lat.sort()
    events = puts * FLIGHT_BATCH
    return {
        "events_per_s": events / took,
        "seconds": took,
        "p50_ms": lat[len(lat) // 2] * 1000,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        "agent_cpu_us_per_event": cpu / events * 1e6,
    }


SYSTEMS: dict[str, Any] = {
    "put_many (in-process)": lambda d, s, n: in_process(d, s, n),
    "http 1 client": lambda d, s, n: over_http(d, s, n, 1, False),
    "http 1 client + key": lambda d, s, n: over_http(d, s, n, 1, True),
    "http 4 clients + key": lambda d, s, n: over_http(d, s, n, 4, True),
    "flight put_batch x1000": lambda d, s, n: over_flight(d, s, n),
}


def main(argv: list[str] | None = None) -> int:
    st = bench_start("agent", __doc__ or "", argv, quick_n=800)
    n, repeats, root = st.n, st.repeats, st.root
    n = max(BATCH * 4, n // (BATCH * 4) * BATCH * 4)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for rep in range(repeats):
            for size in SIZES:
                order = list(SYSTEMS) if rep % 2 == 0 else list(reversed(SYSTEMS))
                got: dict[str, dict[str, Any]] = {}
                for system in order:
                    d = os.path.join(root, f"r{rep}-{size}-{len(got)}", "c")
                    os.makedirs(os.path.dirname(d))
                    got[system] = SYSTEMS[system](d, size, n)
                    runs.setdefault((size, system), []).append(got[system])
                    shutil.rmtree(os.path.dirname(d), ignore_errors=True)
                base = got["put_many (in-process)"]["events_per_s"]
                for system, m in got.items():
                    if system != "put_many (in-process)":
                        ratios.setdefault((size, f"{system} / put_many"), []).append(
                            {"ratio": m["events_per_s"] / base}
                        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common = {"machine": st.machine["host"], "fsync": "commit", "workload": "put x100"}
    rows = rate_rows(runs, ratios, ("event_size", "system"), **common)
    cmd, run = run_record("agent", argv, st.machine, st.t_start, st.load_before, n=n, repeats=repeats)
    lines = table_head(cmd, run, ["size", "system", "median", "min", "max", "p50 ms", "p99 ms", "agent CPU µs/event"])
    for r in sorted(rows, key=lambda r: (r["event_size"], r["unit"], r["system"])):
        ex = r.get("extra", {})
        extra = " | ".join(f"{ex[k]:.2f}" if k in ex else "" for k in ("p50_ms", "p99_ms", "agent_cpu_us_per_event"))
        lines.append(f"| {r['event_size']} | {r['system']} | {spread_cells(r)} | {extra} |")
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
