"""The soak's parts without Spark (bench/soak.py): the TCP fault proxy, the ledger, the schedule, the bodies."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.soak import KINDS, FaultProxy, Ledger, Soak, body_of, parse_body


@pytest.fixture
def echo() -> Iterator[int]:
    """A loopback echo server's port."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    stop.set()
    t.join(2)
    srv.close()


def _roundtrip(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return s.recv(65536)


def _talk(s: socket.socket) -> None:
    """Send and read on ``s`` for a while; a reset or an end of stream raises ``OSError``."""
    for _ in range(50):
        s.sendall(b"y" * 1000)
        if not s.recv(10):
            raise ConnectionResetError("the connection ended")
        time.sleep(0.02)


def test_the_proxy_forwards_delays_cuts_and_black_holes(echo: int) -> None:
    px = FaultProxy(echo)
    try:
        assert _roundtrip(px.port, b"hello") == b"hello"
        px.delay = 0.3
        t = time.monotonic()
        assert _roundtrip(px.port, b"slow") == b"slow"
        assert time.monotonic() - t >= 0.5  # each direction waits
        px.delay = 0.0
        # a cut resets a connection mid-stream
        s = socket.create_connection(("127.0.0.1", px.port), timeout=5)
        s.sendall(b"x")
        assert s.recv(10) == b"x"
        assert px.cut() == 1
        with pytest.raises(OSError):
            _talk(s)
        s.close()
        # a black hole: nothing comes back until it ends
        px.blackhole_until = time.monotonic() + 1.5
        with pytest.raises(TimeoutError):
            _roundtrip(px.port, b"lost?", timeout=0.8)
        time.sleep(1.0)
        assert _roundtrip(px.port, b"back") == b"back"
    finally:
        px.close()


def test_the_ledger_tells_acknowledged_from_doubtful_batches(tmp_path: Path) -> None:
    p = tmp_path / "l.log"
    p.write_text("I 0 0 9\nA 0 10\nI 1 10 14\nA 1 5\nI 2 15 19\nA 2")  # batch 2 sent, its ack torn
    led = Ledger.read(p)
    assert led.acked_seqs() == set(range(15))
    assert led.doubtful_seqs() == set(range(15, 20))


def test_bodies_name_their_producer_and_number() -> None:
    b = body_of("http-h1", 42)
    assert len(b) == 80
    assert parse_body(b) == ("http-h1", 42)
    assert body_of("http-h1", 43) != b
    assert parse_body(b"no numbers here") is None


@pytest.mark.parametrize("disk", [False, True])
def test_seed_1_of_a_three_minute_soak_schedules_every_kind(tmp_path: Path, disk: bool) -> None:
    args = argparse.Namespace(seed=1, workdir=str(tmp_path))
    soak = Soak.__new__(Soak)
    soak.args, soak.disk = args, disk
    sched = soak.schedule(60.0, 165.0)  # the window a 3-minute soak has if Spark needs a minute to start
    kinds = {k for _, k in sched}
    assert kinds == {k for k in KINDS if k != "disk_full" or disk}
    assert all(60.0 <= t < 165.0 for t, _ in sched)
    assert soak.schedule(60.0, 165.0) == sched  # the seed decides
