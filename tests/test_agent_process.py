"""`filechannel serve` as a process: SIGKILL between calls and restart, SIGTERM, SIGSTOP (deadlines), --check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("pyarrow.flight")

from helpers import agent_command
from test_agent import cid_of, make_channel

import filechannel
from filechannel.agent import AgentTimeoutError, AgentUnavailableError, connect
from filechannel.reader import ChannelReader

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class AgentProcess:
    """``filechannel serve DIR --listen grpc://127.0.0.1:0 --port-file F`` in a child process."""

    def __init__(self, dirs: list[str], port_file: Path, *extra: str) -> None:
        self.port_file = port_file
        if port_file.exists():
            port_file.unlink()  # a SIGKILLed agent leaves its port file behind
        self.proc = subprocess.Popen(
            agent_command(dirs, port_file, *extra),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the agent exited: {self.proc.communicate()[1]}")
            if time.monotonic() > deadline:
                raise AssertionError("the agent wrote no port file within 30 s")
            time.sleep(0.05)
        self.uri = f"grpc://127.0.0.1:{int(port_file.read_text())}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for a in started:
        a.kill()


def test_sigkill_between_calls_loses_nothing_and_keeps_acks(tmp_path: Path, agents: list[AgentProcess]) -> None:
    d = make_channel(tmp_path / "c", 50)
    cid = cid_of(d)
    pf = tmp_path / "port"
    # The owner keeps the channel open and writes while the agent serves it.
    owner = filechannel.open(d, minimum_required_space=0)
    try:
        agents.append(AgentProcess([d], pf))
        c = connect(agents[-1].uri, timeout=5)
        assert c.register(cid, "q", "query-1") == 0
        first = c.read(cid, 0, 30)
        assert c.ack(cid, "q", 30, "query-1") == 30
        agents[-1].proc.send_signal(signal.SIGKILL)
        agents[-1].proc.wait(timeout=30)
        t0 = time.monotonic()
        with pytest.raises(AgentUnavailableError):
            c.available(cid, "q", "query-1")
        assert time.monotonic() - t0 < 5.0
        with owner.transaction() as tx:  # written while no agent runs
            for i in range(50, 60):
                tx.put(b"ev-%d" % i, headers={"i": str(i)})

        agents.append(AgentProcess([d], pf))
        c = connect(agents[-1].uri, timeout=5)
        assert c.register(cid, "q", "query-1") == 30  # the ack survived the kill
        assert c.available(cid, "q", "query-1") == (30, 60)
        rest = c.read(cid, 30, 60)
        with ChannelReader(d) as view:  # the owner may have taken [0, 30) already: it applies acks
            assert rest == view.read(30, 60)
        assert [e.body for e in first + rest] == [b"ev-%d" % i for i in range(60)]
        # A kill right after an ack: the ack is durable when the call returns.
        assert c.ack(cid, "q", 60, "query-1") == 60
        agents[-1].proc.send_signal(signal.SIGKILL)
        agents[-1].proc.wait(timeout=30)
        agents.append(AgentProcess([d], pf))
        c = connect(agents[-1].uri, timeout=5)
        st = c.status()["channels"][0]
        assert st["consumers"]["q"]["acked"] == 60
        assert st["end"] == 60  # (the owner may have taken what was acknowledged already)
        # The owner turns the acknowledgement into a take.
        owner.apply_acks()
        assert c.available(cid) == (60, 60)
    finally:
        owner.close()


def test_sigterm_stops_the_agent_gracefully(tmp_path: Path, agents: list[AgentProcess]) -> None:
    d = make_channel(tmp_path / "c", 5)
    pf = tmp_path / "port"
    agents.append(AgentProcess([d], pf))
    a = agents[-1]
    assert len(connect(a.uri, timeout=5).read(cid_of(d), 0, 5)) == 5
    a.proc.send_signal(signal.SIGTERM)
    _, err = a.proc.communicate(timeout=30)
    assert a.proc.returncode == 0
    assert "stopped serving" in err
    assert "Traceback" not in err
    assert not pf.exists()
    with pytest.raises(AgentUnavailableError):
        connect(a.uri, timeout=5).channels()


def _wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped (state ``T`` in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_a_stopped_process_fails_calls_at_their_deadline(tmp_path: Path, agents: list[AgentProcess]) -> None:
    d = make_channel(tmp_path / "c", 5)
    agents.append(AgentProcess([d], tmp_path / "port"))
    a = agents[-1]
    c = connect(a.uri, timeout=1.0)
    assert c.available(cid_of(d)) == (0, 5)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        _wait_stopped(a.proc.pid)  # the signal is delivered asynchronously: the call must meet a stopped agent
        t0 = time.monotonic()
        with pytest.raises(AgentTimeoutError, match="no answer within 1 s"):
            c.read(cid_of(d), 0, 5)
        assert time.monotonic() - t0 < 4.0
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert len(c.read(cid_of(d), 0, 5)) == 5


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "filechannel", *args], env=_env(), capture_output=True, text=True, timeout=60
    )


def test_check_prints_what_would_be_served_and_binds_nothing(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 7)
    pf = tmp_path / "port"
    r = _cli("serve", d, "--listen", "grpc://127.0.0.1:0", "--port-file", str(pf), "--check")
    assert r.returncode == 0, r.stderr
    assert f"channel {cid_of(d)} {d}: positions [0, 7)" in r.stdout
    assert "would listen on grpc://127.0.0.1:0" in r.stdout
    assert not pf.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "grpc://0.0.0.0:8815"], "--listen: grpc://0.0.0.0:8815: plain grpc:// is for a loopback address"),
        (["--listen", "grpc+tls://0.0.0.0:8815"], "--tls-cert: grpc+tls://0.0.0.0:8815: grpc+tls needs --tls-cert"),
        (["--listen", "grpc://127.0.0.1:0", "--client-ca", "x.pem"], "--client-ca: applies to grpc+tls:// only"),
        (["--listen", "grpc://127.0.0.1:0", "--allow", "=x"], "--allow '=x': give NAME"),
        (["--listen", "grpc://127.0.0.1:0", "--allow-consumer", "x"], "--allow-consumer 'x': give NAME=CONSUMER"),
        (["--listen", "grpc://127.0.0.1:0", "--allow-consumer", "x=q"], "--allow-consumer: certificate names come"),
        (["--listen", "grpc://127.0.0.1:0", "--allow-writer", "x"], "--allow-writer: certificate names come"),
    ],
)
def test_serve_refuses_bad_options_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    d = make_channel(tmp_path / "c", 1)
    r = _cli("serve", d, *args, "--check")
    assert r.returncode == 2
    assert r.stderr.startswith("filechannel: error: " + message), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_takes_its_options_from_a_toml_file(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 3)
    conf = tmp_path / "agent.toml"
    conf.write_text(f'channels = ["{d}=orders"]\nlisten = "grpc://127.0.0.1:0"\nwritable = true\ncapacity = 50\n')
    r = _cli("serve", "--config", str(conf), "--check")
    assert "exceeds capacity=50" in r.stderr  # the file's capacity reached the channel options
    conf.write_text(f'channels = ["{d}=orders"]\nlisten = "grpc://127.0.0.1:0"\nwritable = true\ncapacity = 50000\n')
    r = _cli("serve", "--config", str(conf), "--check")
    assert r.returncode == 0, r.stderr
    assert f"channel {cid_of(d)} {d}: positions [0, 3)" in r.stdout
    assert "would listen on grpc://127.0.0.1:0" in r.stdout
    # A flag on the command line wins over the file.
    r = _cli("serve", "--config", str(conf), "--listen", "grpc://0.0.0.0:9", "--check")
    assert r.returncode == 2
    assert "plain grpc:// is for a loopback address" in r.stderr
    for text, message in (
        ('listen = "grpc://127.0.0.1:0"\nlisten_twice = 1\n', "unknown key 'listen_twice'"),
        ("listen = [", "not TOML"),
        ('channels = "x"\n', "channels must be a list"),
    ):
        conf.write_text(text)
        r = _cli("serve", "--config", str(conf), "--check")
        assert r.returncode == 2, text
        assert message in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = _cli("serve", "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 2
    assert "missing.toml" in r.stderr


def test_restartable_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    """An outgoing connection never takes such a port as its local one, so a restart can bind it again."""
    from filechannel.testing.processes import restartable_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [restartable_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)  # never the same port twice in one process
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
