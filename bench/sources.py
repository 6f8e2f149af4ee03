"""The agent's push sources (syslog, RELP, OTLP, forward) against the HTTP source, Flight puts and a bare socket.

    .venv/bin/python -m bench.sources [--n N] [--repeats R] [--quick] [--data-dir DIR]

Prints one JSON line per result on stdout and a summary table on stderr.
Workload: events of 100 B in requests (messages, puts) of 100 events, each one
channel transaction with ``fsync="commit"``, answered after the commit; one
client, then 8 concurrent clients (each on its own connection, one request at a
time). N events per case.

Systems (``SYSTEMS``; another source adds a row by adding a function there,
taking the running agent, the event size, the events per client and the client
count, returning events/s):
- ``tcp discard (ceiling)``: the same forward bytes into a plain TCP socket of
  the agent's host that reads and discards them (no decode, no commit; a thread
  here): what the loopback and the client side alone allow;
- ``otlp protobuf``: ``POST /v1/logs`` with an ``ExportLogsServiceRequest`` of 100 records;
- ``forward + chunk``: Forward mode messages of 100 entries with the ``chunk`` option, each waiting for its ack;
- ``syslog tcp octet``: RFC 5424 frames with a 100-byte MSG, octet-counted, 100 to a ``send``; syslog over
  TCP answers nothing, so the clock stops when the agent's ``filechannel_source_events_total{source="syslog"}``
  counts every frame committed;
- ``relp``: 100 RELP ``syslog`` commands (the same frames) per ``send``, each batch waiting for its 100
  ``rsp 200`` (answered after the commit; rsyslog's ``omrelp`` keeps up to 128 in flight);
- ``http json``: the HTTP source, Flume JSON bodies of 100 events;
- ``flight put_batch``: exactly-once Flight puts of 100 events.

One agent (``filechannel serve --writable --http --forward --syslog --relp``, a child process)
serves every case of a repeat, one case after the other. Ratios within a
repeat: each system against ``http json`` and against the ceiling, at the same
client count; summarised as median and min-max over the repeats.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .agent import BenchAgent
from .run import bench_start, rate_rows, run_record, spread_cells, table_head

BATCH = 100
SIZE = 100
CLIENTS = (1, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parallel(clients: int, work: Callable[[int], int]) -> float:
    """Run ``work(k)`` (returning events sent) on ``clients`` threads; events/s over the wall time."""
    counts = [0] * clients
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            counts[k] = work(k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]}")
    return sum(counts) / took


# -- payloads --------------------------------------------------------------------------------


def _pb_len(num: int, payload: bytes) -> bytes:
    return _varint((num << 3) | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def otlp_request(size: int, records: int) -> bytes:
    """An ``ExportLogsServiceRequest`` of ``records`` records with a ``size``-byte string body (hand-encoded)."""
    body = _pb_len(1, b"x" * size)  # AnyValue.string_value
    rec = b"\x09" + (1_700_000_000 * 10**9).to_bytes(8, "little") + b"\x10\x09" + _pb_len(5, body)
    scope_logs = b"".join(_pb_len(2, rec) for _ in range(records))
    resource = _pb_len(1, _pb_len(1, _pb_len(1, b"service.name") + _pb_len(2, _pb_len(1, b"bench"))))
    return _pb_len(1, resource + _pb_len(2, scope_logs))


def forward_message(size: int, entries: int, chunk: str | None) -> bytes:
    import msgpack

    record = {"m": "x" * (size - 8)}  # {"m":"..."} is 8 bytes of JSON around the text
    opts = {"chunk": chunk} if chunk is not None else {}
    return bytes(msgpack.packb(["bench", [[1_700_000_000, record]] * entries, opts]))


# -- systems ---------------------------------------------------------------------------------


def tcp_discard(agent: Any, size: int, per_client: int, clients: int) -> float:
    payload = forward_message(size, BATCH, None)
    srv = socket.create_server(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    stop = threading.Event()

    def sink(conn: socket.socket) -> None:
        with conn:
            while conn.recv(1 << 16):
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=sink, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()

    def work(k: int) -> int:
        with socket.create_connection(("127.0.0.1", port)) as s:
            for _ in range(per_client // BATCH):
                s.sendall(payload)
        return per_client // BATCH * BATCH

    try:
        return _parallel(clients, work)
    finally:
        stop.set()
        srv.close()


def _post(port: int, path: str, payload: bytes, headers: dict[str, str], requests: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        for _ in range(requests):
            conn.request("POST", path, body=payload, headers=headers)
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status} from {path}")
    finally:
        conn.close()


def otlp_protobuf(agent: Any, size: int, per_client: int, clients: int) -> float:
    payload = otlp_request(size, BATCH)
    hdrs = {"Content-Type": "application/x-protobuf"}

    def work(k: int) -> int:
        _post(agent.port, "/v1/logs", payload, hdrs, per_client // BATCH)
        return per_client // BATCH * BATCH

    return _parallel(clients, work)


def http_json(agent: Any, size: int, per_client: int, clients: int) -> float:
    payload = json.dumps([{"body": "x" * size}] * BATCH).encode()
    hdrs = {"Content-Type": "application/json"}

    def work(k: int) -> int:
        _post(agent.port, "/v1/channels/c/events", payload, hdrs, per_client // BATCH)
        return per_client // BATCH * BATCH

    return _parallel(clients, work)


_CHUNKS = iter(range(1 << 62))


def forward_chunk(agent: Any, size: int, per_client: int, clients: int) -> float:
    import msgpack

    requests = per_client // BATCH
    # every chunk id unique over the whole run (the agent remembers the newest 1024 of the channel)
    ids = [[f"b{next(_CHUNKS)}" for _ in range(requests)] for _ in range(clients)]
    payloads = [[forward_message(size, BATCH, c) for c in row] for row in ids]

    def work(k: int) -> int:
        with socket.create_connection(("127.0.0.1", agent.forward_port), timeout=60) as s:
            u = msgpack.Unpacker(raw=False)
            for msg, chunk in zip(payloads[k], ids[k], strict=True):
                s.sendall(msg)
                ack = None
                while ack is None:
                    data = s.recv(4096)
                    if not data:
                        raise RuntimeError("the agent closed the forward connection")
                    u.feed(data)
                    ack = next(u, None)
                if ack != {"ack": chunk}:
                    raise RuntimeError(f"wrong ack {ack!r}")
        return requests * BATCH

    return _parallel(clients, work)


def syslog_frame(size: int, i: int) -> bytes:
    """An RFC 5424 message with a ``size``-byte MSG."""
    msg = b"x" * (size - 8) + b"%08d" % (i % 10**8)
    return b"<13>1 2023-11-14T22:13:20Z bench app - - - " + msg


def _source_events(agent: Any, source: str) -> float:
    """The agent's ``filechannel_source_events_total`` of ``source`` (summed over channels) from ``/metrics``."""
    conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    prefix = "filechannel_source_events_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and f'source="{source}"' in line
    )


def syslog_tcp(agent: Any, size: int, per_client: int, clients: int) -> float:
    batches = per_client // BATCH
    payload = b"".join(b"%d %s" % (len(f), f) for f in (syslog_frame(size, i) for i in range(BATCH)))
    before = _source_events(agent, "syslog")
    t0 = time.perf_counter()

    def work(k: int) -> int:
        with socket.create_connection(("127.0.0.1", agent.syslog_port), timeout=60) as s:
            for _ in range(batches):
                s.sendall(payload)
        return batches * BATCH

    _parallel(clients, work)
    want = before + clients * batches * BATCH
    deadline = time.monotonic() + 120
    while _source_events(agent, "syslog") < want:
        if time.monotonic() > deadline:
            raise RuntimeError("the agent did not commit every syslog frame within 120 s")
        time.sleep(0.002)
    return clients * batches * BATCH / (time.perf_counter() - t0)


def _relp_read(s: socket.socket, buf: bytearray, answers: int) -> None:
    """Read until ``answers`` RELP ``rsp`` frames arrived (each must be ``200``); leave the rest in ``buf``."""
    got = 0
    while got < answers:
        head = buf.split(b" ", 3)  # TXNR SP COMMAND SP DATALEN [SP DATA] LF
        end = -1
        if len(head) >= 3:
            size = head[2].split(b"\n", 1)[0]
            start = len(head[0]) + len(head[1]) + len(size) + 3  # past "TXNR rsp LEN" and a space or the LF
            end = start + int(size) if size.isdigit() else -1
            if int(size or b"0") == 0:
                end = start - 1
        if end < 0 or len(buf) <= end:
            data = s.recv(1 << 16)
            if not data:
                raise RuntimeError("the agent closed the RELP session")
            buf += data
            continue
        frame = bytes(buf[: end + 1])
        del buf[: end + 1]
        if head[1] != b"rsp" or (int(head[2].split(b"\n", 1)[0]) and not frame.split(b" ", 3)[3].startswith(b"200")):
            raise RuntimeError(f"RELP: {frame[:80]!r}")
        got += 1


def _relp_cmd(txnr: int, command: bytes, data: bytes) -> bytes:
    return b"%d %s %d %s\n" % (txnr, command, len(data), data) if data else b"%d %s 0\n" % (txnr, command)


def relp(agent: Any, size: int, per_client: int, clients: int) -> float:
    batches = per_client // BATCH
    frames = [syslog_frame(size, i) for i in range(BATCH)]

    def work(k: int) -> int:
        with socket.create_connection(("127.0.0.1", agent.relp_port), timeout=60) as s:
            buf = bytearray()
            s.sendall(_relp_cmd(1, b"open", b"relp_version=0\nrelp_software=bench\ncommands=syslog"))
            _relp_read(s, buf, 1)
            txnr = 2
            for _ in range(batches):
                s.sendall(b"".join(_relp_cmd(txnr + i, b"syslog", f) for i, f in enumerate(frames)))
                txnr += BATCH
                _relp_read(s, buf, BATCH)
            s.sendall(_relp_cmd(txnr, b"close", b""))
            _relp_read(s, buf, 1)
        return batches * BATCH

    return _parallel(clients, work)


def flight_put_batch(agent: Any, size: int, per_client: int, clients: int) -> float:
    from filechannel.agent import connect

    bodies = [b"x" * size] * BATCH
    with connect(f"grpc://127.0.0.1:{agent.flight_port}", timeout=60) as c0:
        cid = next(iter(c0.channels()))
    producer = f"p{next(_CHUNKS)}"

    def work(k: int) -> int:
        with connect(f"grpc://127.0.0.1:{agent.flight_port}", timeout=60) as client:
            for seq in range(1, per_client // BATCH + 1):
                client.put_batch(cid, bodies, producer=f"{producer}-{k}", sequence=seq)
        return per_client // BATCH * BATCH

    return _parallel(clients, work)


# name -> fn(agent, event size, events per client, clients) -> events/s
SYSTEMS: dict[str, Callable[[Any, int, int, int], float]] = {
    "tcp discard (ceiling)": tcp_discard,
    "otlp protobuf": otlp_protobuf,
    "forward + chunk": forward_chunk,
    "syslog tcp octet": syslog_tcp,
    "relp": relp,
    "http json": http_json,
    "flight put_batch": flight_put_batch,
}
BASELINES = ("http json", "tcp discard (ceiling)")


def main(argv: list[str] | None = None) -> int:
    st = bench_start("sources", __doc__ or "", argv, quick_n=1600)
    n, repeats, root = st.n, st.repeats, st.root
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    ratios: dict[tuple[int, str], list[dict[str, Any]]] = {}
    try:
        for rep in range(repeats):
            d = os.path.join(root, f"r{rep}", "c")
            os.makedirs(os.path.dirname(d))
            fport, sport, rport = _free_port(), _free_port(), _free_port()
            agent = BenchAgent(
                d,
                *("--forward", f"tcp://127.0.0.1:{fport}", "--syslog", f"tcp://127.0.0.1:{sport}"),
                *("--relp", f"tcp://127.0.0.1:{rport}", "--capacity", "10000000"),
            )
            agent.forward_port = fport  # type: ignore[attr-defined]
            agent.syslog_port = sport  # type: ignore[attr-defined]
            agent.relp_port = rport  # type: ignore[attr-defined]
            try:
                for clients in CLIENTS:
                    per_client = max(BATCH, n // clients // BATCH * BATCH)
                    order = list(SYSTEMS) if rep % 2 == 0 else list(reversed(SYSTEMS))
                    got = {s: SYSTEMS[s](agent, SIZE, per_client, clients) for s in order}
                    for system, eps in got.items():
                        runs.setdefault((clients, system), []).append({"events_per_s": eps})
                        for base in BASELINES:
                            if system != base:
                                key = (clients, f"{system} / {base}")
                                ratios.setdefault(key, []).append({"ratio": eps / got[base]})
            finally:
                agent.stop()
            shutil.rmtree(os.path.dirname(d), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common = {"machine": st.machine["host"], "fsync": "commit", "event_size": SIZE, "workload": f"put x{BATCH}"}
    rows = rate_rows(runs, ratios, ("clients", "system"), **common)
    cmd, run = run_record("sources", argv, st.machine, st.t_start, st.load_before, n=n, repeats=repeats)
    lines = table_head(cmd, run, ["clients", "system", "median", "min", "max"])
    for r in sorted(rows, key=lambda r: (r["clients"], r["unit"], r["system"])):
        lines.append(f"| {r['clients']} | {r['system']} | {spread_cells(r)} |")
    print("\n".join(lines), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
