"""The Spark sink through an agent whose channel's file system fills up: back-pressure, not a failed query.

The agent runs in a child in a private mount namespace (``unshare --mount``,
or ``unshare -rm`` when not root) with its channel on a 6 MiB tmpfs nobody else
sees; a streaming query in the shared local session writes into it through the
agent more than the tmpfs holds, while nothing takes. When the disk is full the
agent refuses (its full-channel error: the floor ``minimum_required_space``
reached, or a write undone after ENOSPC), the sink waits and retries (tasks
staging their rows, the driver committing a batch), and neither the query nor
the agent's channel fails. A consumer then drains through the agent (reads and
acknowledges, so the channel takes and retires files), space comes back by
itself, and the query finishes: every row is in the channel exactly once, each
batch whole, and no staged file is left behind.

First the tmpfs is filled with a file that is not the channel's, so the first
tasks' stages are refused (the agent stages only above the floor) and wait;
then the query's own rows fill it, and the driver's commits are refused and wait.

Without a JVM: a stage whose write runs out of space (no floor) is the full
error at the client and leaves no file; a commit waits for a consumer, then
lands once; a channel that stays full fails the stage or the commit after
``agentFullWaitMs`` with an error that says what to do.

Skipped with the reason only where the kernel refuses a mount namespace; where
``unshare --mount`` works, a tmpfs that cannot be mounted fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import pytest

SKIP_RC = 77
MiB = 1 << 20
TMPFS = "6m"
OPTS: dict[str, Any] = {"max_file_size": 256 * 1024, "minimum_required_space": MiB, "keep_alive": 0.5}
BATCHES, ROWS, ROW_BYTES = 16, 120, 4000  # ~7.7 MB of rows (and as much staged) for 6 MiB
CONSUMER = "drain"


def _namespaces_allowed() -> bool:
    ns = ["unshare", "--mount", "true"] if os.geteuid() == 0 else ["unshare", "-rm", "true"]
    return subprocess.run(ns, capture_output=True, check=False).returncode == 0


class _Agent:
    """The agent child: a writable agent serving one channel on a private tmpfs, driven by lines on stdin."""

    def __init__(self, tmp_path: Path, options: dict[str, Any] = OPTS) -> None:
        if shutil.which("unshare") is None or not _namespaces_allowed():
            pytest.skip("the kernel (or the container) refuses a private mount namespace: `unshare --mount` fails")
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        ns = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else ["unshare", "-rm"]
        script = f'mount -t tmpfs -o size={TMPFS} tmpfs "$0" || exit {SKIP_RC}; exec "$1" "$2" "$0" "$3"'
        self.log_path = tmp_path / "agent.log"
        self._log: IO[str] = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.p = subprocess.Popen(
            [*ns, "sh", "-c", script, str(mnt), sys.executable, __file__, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        first = self._line()
        self.location: str = first["location"]
        self.channel: str = first["channel"]

    def _line(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait(30)
            assert rc != SKIP_RC, f"`unshare --mount` works here, but mounting a tmpfs failed:\n{self.log()}"
            raise AssertionError(f"the agent child exited ({rc}):\n{self.log()}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._line()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-6000:]

    def stop(self) -> dict[str, Any]:
        try:
            return self.ask("stop")
        finally:
            self.p.wait(60)
            self._log.close()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)
        self._log.close()


def _json_input(d: Path) -> list[str]:
    d.mkdir(parents=True)
    rows = []
    for b in range(BATCHES):
        path = d / f"part-{b:03d}.json"
        with open(path, "w") as f:
            for j in range(ROWS):
                body = f"row-{b:03d}-{j:04d}-".ljust(ROW_BYTES, "x")
                rows.append(body)
                f.write(json.dumps({"body": body}) + "\n")
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))
    return rows


def _refused(st: dict[str, Any]) -> int:
    """Refusals for want of room so far: the channel's (commits) and the staging area's (stages)."""
    return int(st["space_refusals"] + st["channel_full"] + st["stage_refusals"])


def _until(agent: _Agent, q: Any, cond: Any, why: str) -> dict[str, Any]:
    """The agent's stats once ``cond`` holds of them (the query still running); fails with ``why`` after 240 s."""
    deadline = time.monotonic() + 240
    while True:
        st = agent.ask("stats")
        if cond(st):
            return st
        assert q.isActive, f"the query ended ({why}): {q.exception()}\n{agent.log()}"
        assert time.monotonic() < deadline, f"{why}: {st}\n{agent.log()}"
        time.sleep(0.2)


def _drain(client: Any, channel: str, got: list[Any]) -> int:
    """Read what the consumer has not acknowledged, through the agent, and acknowledge it; how many events."""
    start, end = client.available(channel, CONSUMER)
    n = 0
    while start < end:
        evs = client.read(channel, start, min(end, start + 200))
        if not evs:
            break
        got.extend(evs)
        start = evs[-1].position + 1
        client.ack(channel, CONSUMER, start)
        n += len(evs)
    return n


@pytest.mark.spark
def test_a_full_disk_under_the_agent_makes_the_sink_wait_and_the_query_finishes_exactly_once(
    spark: Any, tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow.flight")
    from filechannel.agent.client import connect
    from filechannel.spark.sink import HEADER_BATCH

    rows = _json_input(tmp_path / "in")
    agent = _Agent(tmp_path)
    q = None
    try:
        client = connect(agent.location)
        client.register(agent.channel, CONSUMER)
        df = (
            spark.readStream.schema("body string")
            .option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / "in"))
            .repartition(2)
        )
        w = df.writeStream.format("filechannel").option("agent", agent.location)
        # The tmpfs is full of something else: the first tasks' stages are refused, and wait.
        agent.ask(f"fill {MiB + 64 * 1024}")
        q = w.option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start()
        st = _until(agent, q, lambda st: st["stage_refusals"] >= 3, "the stages were never refused")
        assert st["queue_size"] == 0, st
        assert st["staging"] == [], st  # refused before a staged file was made
        assert not st["failed"], st
        agent.ask("unfill")
        # Space came back: the waiting stages went through by themselves, and batch 0 committed.
        before = _refused(_until(agent, q, lambda st: st["queue_size"] > 0, "the stages did not resume"))

        # Nothing takes: the query's own rows fill the disk, and the agent refuses (the floor, or a write undone).
        full = _until(agent, q, lambda st: _refused(st) > before, "the disk never filled")
        time.sleep(6)  # full for a while: the sink keeps waiting (its tasks or its commit), nothing fails
        st = agent.ask("stats")
        assert q.isActive, f"the query failed on a full disk: {q.exception()}\n{agent.log()}"
        assert not st["failed"], st
        assert _refused(st) > _refused(full), ("the sink stopped trying while the channel was full", st)
        assert st["disk_free"] < 2 * MiB, st

        # A consumer drains; the query goes on by itself and finishes.
        got: list[Any] = []
        deadline = time.monotonic() + 300
        while q.isActive:
            _drain(client, agent.channel, got)
            assert time.monotonic() < deadline, f"the query did not finish after space came back\n{agent.log()}"
            q.awaitTermination(0.5)
        assert q.exception() is None, f"{q.exception()}\n{agent.log()}"
        _drain(client, agent.channel, got)
        client.close()
        end = agent.stop()
    except BaseException:
        agent.kill()
        raise
    finally:
        if q is not None and q.isActive:
            q.stop()

    bodies = [e.body.decode() for e in got]
    twice = [b[:12] for b, n in Counter(bodies).items() if n > 1]
    assert not twice, f"rows put twice: {twice[:10]}"
    missing = sorted(set(rows) - set(bodies))
    assert not missing, f"{len(missing)} rows lost, e.g. {[m[:12] for m in missing[:10]]}"
    assert sorted(bodies) == sorted(rows)
    # Each micro-batch is one transaction: its rows are together, in one run of positions.
    per_batch = Counter(e.headers[HEADER_BATCH] for e in got)
    assert sorted(per_batch.values()) == [ROWS] * BATCHES, per_batch
    runs = [e.headers[HEADER_BATCH] for e in got]
    assert [b for i, b in enumerate(runs) if i == 0 or runs[i - 1] != b] == sorted(per_batch, key=int)
    assert end["failed"] is False, end
    assert end["files_retired"] > 0, end
    assert end["staging"] == [], f"staged files left at the agent: {end['staging']}"


# -- without a JVM: the agent's answers and the sink's waits -------------------------------------


def test_a_stage_that_runs_out_of_space_is_the_full_error_and_leaves_nothing(tmp_path: Path) -> None:
    """No floor: the staged file's write itself gets ENOSPC; the client sees the channel's full error."""
    pytest.importorskip("pyarrow.flight")
    from filechannel.agent.client import connect
    from filechannel.errors import ChannelFullError

    agent = _Agent(tmp_path, {**OPTS, "minimum_required_space": 0})
    try:
        client = connect(agent.location)
        big = [(b"b" * 65536, None)] * 128  # 8 MiB for a 6 MiB tmpfs
        with pytest.raises(ChannelFullError) as got:
            client.sink_stage(agent.channel, big, partition=0, attempt=0, query="q1", batch_id=0)
        assert got.value.reason == "disk_full"
        assert "no space left" in str(got.value)
        st = agent.ask("stats")
        assert st["staging"] == [], st  # the partial staged file was removed
        assert st["stage_refusals"] == 1, st
        assert not st["failed"], st
        name, rows, _ = client.sink_stage(agent.channel, big[:4], partition=0, attempt=1, query="q1", batch_id=0)
        assert rows == 4
        assert agent.ask("stats")["staging"] == [name]
        client.close()
        assert agent.stop()["failed"] is False
    except BaseException:
        agent.kill()
        raise


def _full_agent(tmp_path: Path, **options: Any) -> Any:
    pytest.importorskip("pyarrow.flight")
    import filechannel
    from filechannel.agent import serve

    d = str(tmp_path / "c")
    opts = {"minimum_required_space": 0, "keep_alive": 0.1, **options}
    filechannel.open(d, **opts).close()
    return d, serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=opts)


def test_a_commit_waits_while_the_agents_channel_is_full_and_lands_once_when_drained(tmp_path: Path) -> None:
    import threading

    from filechannel.spark.agent_sink import AgentSinkOptions, AgentSinkTarget

    _, a = _full_agent(tmp_path, capacity=4, transaction_capacity=4)
    with a:
        ch = next(iter(a.channels.values())).channel
        with ch.transaction() as tx:
            for i in range(3):
                tx.put(b"old-%d" % i)
        target = AgentSinkTarget(AgentSinkOptions.from_spark({"agent": a.location}))  # the defaults
        rows = [(b"new-%d" % i, None) for i in range(3)]
        files, n, _ = target.stage(rows, partition=0, attempt=0, query="q1", batch_id=0)
        taken: list[bytes] = []

        def consumer() -> None:
            with ch.transaction() as tx:
                taken.extend(e.body for e in tx.take_batch(3))

        drain = threading.Timer(1.0, consumer)
        drain.start()
        t0 = time.monotonic()
        out = target.commit(files, n, query="q1", batch_id=0)
        drain.join()
        assert time.monotonic() - t0 >= 0.9  # it waited for the consumer
        assert out["committed"] is True
        assert taken == [b"old-0", b"old-1", b"old-2"]
        again = target.commit(files, n, query="q1", batch_id=0)
        assert again["reason"] == "already committed"
        assert ch.stats()["failed"] is False
        with ch.transaction() as tx:
            assert [e.body for e in tx.take_batch(4)] == [b"new-0", b"new-1", b"new-2"]


def test_a_channel_that_stays_full_fails_the_commit_after_agent_full_wait_ms_saying_what_to_do(
    tmp_path: Path,
) -> None:
    from filechannel.errors import ChannelFullError
    from filechannel.spark.agent_sink import AgentSinkOptions, AgentSinkTarget
    from filechannel.spark.sink import SinkOptions

    opts = SinkOptions.from_spark({"agent": "grpc://127.0.0.1:1", "agentFullWaitMs": "300"})
    assert opts.agent is not None
    assert opts.agent.full_wait == 0.3
    _, a = _full_agent(tmp_path, capacity=2, transaction_capacity=2)
    with a:
        ch = next(iter(a.channels.values())).channel
        with ch.transaction() as tx:
            tx.put(b"old")
        target = AgentSinkTarget(AgentSinkOptions(a.location, full_wait=0.3))
        files, n, _ = target.stage([(b"x", None), (b"y", None)], partition=0, attempt=0, query="q1", batch_id=0)
        with pytest.raises(ChannelFullError) as got:
            target.commit(files, n, query="q1", batch_id=0)
        msg = str(got.value)
        assert got.value.reason == "capacity"
        assert "batch 0 of query q1" in msg
        assert "agentFullWaitMs=300" in msg
        assert "consumers take or acknowledge" in msg
        assert ch.stats()["queue_size"] == 1  # nothing of the batch was put
        assert ch.stats()["failed"] is False


def test_a_stage_refused_for_the_floor_waits_then_fails_naming_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from filechannel.errors import ChannelFullError
    from filechannel.spark import agent_sink
    from filechannel.spark.agent_sink import AgentSinkOptions, AgentSinkTarget

    d, a = _full_agent(tmp_path, minimum_required_space=1 << 60)  # never this much free
    with a:
        target = AgentSinkTarget(AgentSinkOptions(a.location, full_wait=0.5))
        rows = [(b"r" * 100, None)] * 10
        t0 = time.monotonic()
        with pytest.raises(ChannelFullError) as got:
            target.stage(rows, partition=3, attempt=0, query="q1", batch_id=7)
        assert time.monotonic() - t0 >= 0.5
        assert got.value.reason == "min_free"
        assert "partition 3 of batch 7" in str(got.value)
        assert "agentFullWaitMs=500" in str(got.value)
        assert "no room to stage a Spark task's rows" in str(got.value)
        # More rows sent than the task keeps: it cannot send them again, and says so at once.
        monkeypatch.setattr(agent_sink, "REPLAY_BYTES", 500)
        with pytest.raises(ChannelFullError, match="cannot send them again"):
            target.stage(rows, partition=3, attempt=1, query="q1", batch_id=7)
        staging = Path(d) / "spark-sink" / "staging"
        assert not staging.exists() or list(staging.iterdir()) == []


# -- the agent child (runs inside the namespace) --------------------------------------------------


def _child(mnt: str, options: dict[str, Any]) -> None:
    import logging

    import filechannel
    from filechannel.agent import serve
    from filechannel.reader import channel_id_of
    from filechannel.staged import SINK_DIR, STAGING_DIR

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    d = os.path.join(mnt, "sink")
    filechannel.open(d, **options).close()
    cid = channel_id_of(d).hex()
    a = serve([d], "grpc://127.0.0.1:0", writable=True, channel_options=options)
    ch = a.channels[cid].channel
    assert ch is not None
    staging = os.path.join(d, SINK_DIR, STAGING_DIR)

    def stats() -> dict[str, Any]:
        s = ch.stats()
        out: dict[str, Any] = {
            "failed": s["failed"],
            "space_refusals": s["space_refusals"],
            "channel_full": s["channel_full"],
            "files_retired": s["files_retired"],
            "disk_free": s["disk_free"],
            "queue_size": s["queue_size"],
        }
        sink = a.channels[cid].sink
        out["stage_refusals"] = getattr(sink, "refusals", 0)
        out["staging"] = sorted(os.listdir(staging)) if os.path.isdir(staging) else []
        return out

    print(json.dumps({"location": a.location, "channel": cid}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "stats":
                print(json.dumps(stats()), flush=True)
            elif cmd.startswith("fill "):  # leave this many bytes free, with a file that is not the channel's
                with open(os.path.join(mnt, "filler"), "wb") as f:
                    f.truncate(0)
                    f.write(b"\0" * max(0, shutil.disk_usage(mnt).free - int(cmd.split()[1])))
                print(json.dumps(stats()), flush=True)
            elif cmd == "unfill":
                os.unlink(os.path.join(mnt, "filler"))
                print(json.dumps(stats()), flush=True)
            elif cmd == "stop":
                break
    finally:
        out = stats()
        a.stop()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
