"""Crash at every persistence point of small workloads, in several ways, and recover.

Each workload (2-6 transactions mixing put, take, commit and rollback, a file
roll with ``max_file_size=4096``, a retirement, a checkpoint, a clean reopen,
an external consumer's registration and acknowledgements and the owner
applying them)
runs once on a :class:`SimFS` that snapshots itself after every mutating call.
For every snapshot and every crash variant (a mode and a seed, see simfs.py)
the post-crash file system is rebuilt and the channel reopened, and the oracle
checks that:

* with ``fsync="commit"``, every transaction whose ``commit()`` returned is
  there exactly once, a commit in flight is all or nothing, nothing rolled
  back or uncommitted is visible, committed takes do not come back, every
  event keeps its position, and recovery raises nothing;
* with ``fsync="interval"``, the recovered state is a prefix of the commit
  order that includes every commit made durable by ``sync()``;
* with an external consumer: its ``.ack`` file holds the last acknowledgement
  that returned, or the one in flight (none before its registration returned,
  none once its removal returned), and the recovered queue is the model's
  minus the positions below that durable acknowledgement (recovery applies an
  acknowledgement that was written but not yet applied);
* the recovered channel accepts a new commit at a fresh position, and a clean
  reopen shows the same state;
* recovery is idempotent: a crash at any point *during* recovery, followed by
  another recovery, gives the same state as the uninterrupted recovery.

Concurrent committers (``Driver.concurrent``): several threads commit at
once on a :class:`ConcurrentSimFS` whose fdatasync takes a few milliseconds
(other threads run meanwhile, as during a real one), so commits form groups
that share one write and one fdatasync. Besides every mutating call, the
moment each commit returns is a crash point: the oracle then demands every
commit that returned, and treats each commit still running as in flight, all
or nothing, at whatever positions recovery shows. Which snapshots are taken
depends on the thread schedule, so these workloads do not replay exactly; the
groups that formed are counted and asserted.

Identical crash states are recovered once; the number of distinct states and
of variants tried is printed and asserted (see docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from simfs import CRASH_VARIANTS, MUTATING_OPS, ConcurrentSimFS, SimFS

import filechannel
from filechannel import checkpoint
from filechannel import format as fmt
from filechannel._runs import RunQueue
from filechannel.consumers import ConsumerStore
from filechannel.log import Log
from filechannel.replay import read_event
from filechannel.writer import CommitResult, Writer

DIR = "/sim/ch"
CONSUMER = "q"
BASE_OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}

VARIANTS: list[tuple[str, int]] = list(CRASH_VARIANTS)
NESTED_VARIANTS: list[tuple[str, int]] = [("drop", 0), ("random", 1)]

TOTALS: dict[str, int] = {
    "snapshots": 0,
    "variants": 0,
    "distinct_states": 0,
    "nested_states": 0,
    "concurrent_commits": 0,
    "groups": 0,
    "grouped_commits": 0,
}


# --------------------------------------------------------------------------
# the reference model


@dataclass
class Effect:
    """What one transaction does if it commits: its puts (position, body), taken positions and marks.

    ``order`` places its marks in commit order: its first position, or (no puts) the
    position counter when it committed minus a half.
    """

    puts: list[tuple[int, bytes]] = field(default_factory=list)
    takes: list[int] = field(default_factory=list)
    marks: dict[str, bytes] = field(default_factory=dict)
    order: float = 0.0


def apply_marks(effects: list[Effect]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for e in sorted((e for e in effects if e.marks), key=lambda e: e.order):
        out.update(e.marks)
    return out


State = tuple[list[tuple[int, bytes]], dict[str, bytes]]
"""What recovery shows: the queue, and the committed marks."""


def state_of(effects: list[Effect]) -> State:
    return apply_effects(effects), apply_marks(effects)


def apply_effects(effects: list[Effect]) -> list[tuple[int, bytes]]:
    q: dict[int, bytes] = {}
    for e in effects:
        for p, b in e.puts:
            assert p not in q
            q[p] = b
        for p in e.takes:
            assert p in q, f"model: take of absent position {p}"
            del q[p]
    return sorted(q.items())


def next_pos(effects: list[Effect]) -> int:
    return max((p + 1 for e in effects for p, _ in e.puts), default=0)


# --------------------------------------------------------------------------
# recording a workload


@dataclass
class Snap:
    fs: SimFS
    acked: tuple[Effect, ...]
    inflight: Effect | None
    durable_upto: int  # with fsync="interval": effects[:n] were made durable by sync()
    op: str
    acks: frozenset[int | None] = frozenset({None})  # what CONSUMER's .ack file may hold (None: no file)
    # Commits of concurrent committers still running: each one's bodies, all or nothing at any positions.
    unplaced: tuple[tuple[bytes, ...], ...] = ()
    unplaced_marks: tuple[dict[str, bytes], ...] = ()  # and each one's marks


class Driver:
    """Runs a workload on a SimFS, keeping the model and a snapshot after every mutating call."""

    def __init__(self, fs: SimFS, opts: dict[str, Any]) -> None:
        self.fs = fs
        self.opts = opts
        self.acked: list[Effect] = []
        self.inflight: Effect | None = None
        self.durable_upto = 0
        self.snaps: list[Snap] = [Snap(fs.snapshot(), (), None, 0, "start")]
        self.queue: list[tuple[int, bytes]] = []  # the model's queue
        self.next_position = 0
        self.counter = 0
        self.acks: frozenset[int | None] = frozenset({None})
        self.ack_mark: int | None = None  # CONSUMER's acknowledgement, once registered
        # Concurrent committers: the model changes under the file system's lock, so every snapshot
        # sees the file system and the model at one instant.
        self.mutex: Any = fs.mutex if isinstance(fs, ConcurrentSimFS) else threading.RLock()
        self.unplaced: list[tuple[bytes, ...]] = []
        self.unplaced_marks: list[dict[str, bytes]] = []
        # Each concurrent commit: (data file, start of its PUTs, end of its COMMIT record, those bytes).
        self.concurrent_commits: list[tuple[str, int, int, bytes]] = []
        fs.on_op = self._hook
        self.ch = filechannel.open(DIR, fs=fs, **opts)

    def _hook(self, op: str, path: str) -> None:
        if op in MUTATING_OPS:
            self._snap(f"{op} {path}")

    def _snap(self, op: str) -> None:
        with self.mutex:
            self.snaps.append(
                Snap(
                    self.fs.snapshot(),
                    tuple(self.acked),
                    self.inflight,
                    self.durable_upto,
                    op,
                    self.acks,
                    tuple(self.unplaced),
                    tuple(self.unplaced_marks),
                )
            )

    def body(self, size: int) -> bytes:
        self.counter += 1
        tag = f"ev{self.counter:04d}:".encode()
        return tag + bytes([65 + self.counter % 26]) * max(0, size - len(tag))

    def txn(
        self,
        puts: list[int] = (),  # type: ignore[assignment]
        takes: int = 0,
        commit: bool = True,
        marks: dict[str, bytes] | None = None,
        arrow: int = 0,
    ) -> None:
        """One transaction; with ``arrow``, its first ``arrow`` puts go in through ``put_arrow`` (no headers)."""
        eff = Effect(marks=dict(marks or {}))
        tx = self.ch.transaction()
        bodies = [self.body(n) for n in puts]
        if arrow:
            import pyarrow as pa

            tx.put_arrow(pa.array(bodies[:arrow], pa.binary()))  # held as one column, framed by encode_column
        for b in bodies[arrow:]:
            tx.put(b, headers={"n": str(len(b))} if len(b) % 2 else None)
        for k, v in (marks or {}).items():
            tx.mark(k, v)
        got = tx.take_batch(takes) if takes else []
        want = self.queue[: len(got)]
        assert [(e.position, e.body) for e in got] == want, "take returned the wrong events"
        if not commit:
            tx.rollback()
            return
        eff.takes = [e.position for e in got]  # type: ignore[misc]
        eff.puts = [(self.next_position + i, b) for i, b in enumerate(bodies)]
        eff.order = self.next_position if bodies else self.next_position - 0.5
        self.inflight = eff
        tx.commit()
        self.inflight = None
        self.acked.append(eff)
        self.next_position += len(bodies)
        self.queue = apply_effects(self.acked)
        assert self.ch.marks() == apply_marks(self.acked)

    def concurrent(
        self,
        threads: int,
        txns: int,
        puts: list[int],
        rollback: frozenset[tuple[int, int]] = frozenset(),
        marks: bool = False,
        arrow: bool = False,
        anchors: bool = False,
        checkpoints: int = 0,
    ) -> None:
        """``threads`` threads commit ``txns`` put-only transactions each, at once.

        With ``arrow``, each transaction's puts go in through one ``put_arrow`` call.
        With ``anchors``, another thread refreshes ``ANCHOR`` (an encrypted channel's
        ``anchor_interval`` step) over and over while they commit.
        With ``checkpoints``, another thread writes up to that many checkpoints while they commit.

        The ``k``-th transaction of thread ``t`` rolls back if ``(t, k)`` is in ``rollback``.
        With ``marks``, each also marks ``producer:<t>`` (its own key) and ``shared`` (every
        thread's): the committed ``shared`` is that of the last commit, whatever the threads' order.
        (The values leave out the bodies' ``ev`` prefix: ``assert_no_plaintext`` looks for mark keys.)
        Needs a :class:`ConcurrentSimFS` with a ``sync_delay``, so that commits group.
        """
        assert isinstance(self.fs, ConcurrentSimFS)
        assert self.fs.sync_delay > 0
        if arrow:
            import pyarrow as pa
        assert self.opts.get("fsync", "commit") == "commit"
        log = self.ch._log
        plain_commit = log.commit
        results = threading.local()

        def commit(*args: Any, **kwargs: Any) -> CommitResult:
            res: CommitResult = plain_commit(*args, **kwargs)
            results.last = res
            return res

        def run(t: int) -> None:
            start.wait()
            for k in range(txns):
                with self.mutex:
                    bodies = tuple(self.body(n) for n in puts)
                tx = self.ch.transaction()
                if arrow:
                    tx.put_arrow(pa.array(bodies, pa.binary()))
                else:
                    for b in bodies:
                        tx.put(b)
                tx_marks = {f"producer:{t}": str(k).encode(), "shared": bodies[0][2:7]} if marks else {}
                for mk, mv in tx_marks.items():
                    tx.mark(mk, mv)
                if (t, k) in rollback:
                    tx.rollback()
                    continue
                with self.mutex:
                    self.unplaced.append(bodies)
                    self.unplaced_marks.append(tx_marks)
                tx.commit()
                res = results.last
                with self.mutex:  # the moment the committer hears "committed" is a crash point
                    i = self.unplaced.index(bodies)
                    del self.unplaced[i], self.unplaced_marks[i]
                    self.acked.append(
                        Effect(
                            puts=[(res.first_position + i, b) for i, b in enumerate(bodies)],
                            marks=tx_marks,
                            order=res.first_position,
                        )
                    )
                    path = log.file_path(res.file_id)
                    a = res.put_offsets[0]
                    z = res.put_offsets[-1] + res.put_sizes[-1] + fmt.record_size(16)
                    self.concurrent_commits.append((path, a, z, self.fs.read(path)[a:z]))
                    self._snap(f"commit returned (thread {t}, {len(self.acked)} acknowledged)")

        errors: list[BaseException] = []

        def guarded(t: int) -> None:
            try:
                if t == -1:
                    refresh()
                elif t == -2:
                    checkpoint()
                else:
                    run(t)
            except BaseException as exc:  # raised below
                errors.append(exc)

        stop = threading.Event()
        refreshes: list[int] = []

        def refresh() -> None:
            while not stop.is_set():
                assert log.refresh_anchor()
                refreshes.append(log.last_woid)

        written: list[int] = []

        def checkpoint() -> None:
            while not stop.is_set() and len(written) < checkpoints:
                self.ch.checkpoint()
                written.append(len(self.acked))
                stop.wait(SYNC_DELAY)

        before = len(self.acked)
        start = threading.Barrier(threads)
        log.commit = commit  # type: ignore[method-assign]
        try:
            workers = [threading.Thread(target=guarded, args=(t,)) for t in range(threads)]
            if anchors:
                workers.append(threading.Thread(target=guarded, args=(-1,)))
            if checkpoints:
                workers.append(threading.Thread(target=guarded, args=(-2,)))
            for w in workers:
                w.start()
            for w in workers[:threads]:
                w.join(120)
            stop.set()
            for w in workers[threads:]:
                w.join(120)
            assert not any(w.is_alive() for w in workers), "a committer hangs"
        finally:
            del log.commit
        if anchors:
            assert len(set(refreshes)) > 1, "no ANCHOR was refreshed while the committers ran"
        if checkpoints:
            # At least one checkpoint began before the last commit returned.
            assert written, "no checkpoint was written"
            assert written[0] < before + threads * txns - len(rollback), "no checkpoint while the committers ran"
        if errors:
            raise errors[0]
        self.next_position = next_pos(self.acked)
        self.queue = apply_effects(self.acked)
        assert self.ch.stats()["next_position"] == self.next_position
        assert self.ch.marks() == apply_marks(self.acked)

    def group_sizes(self) -> list[int]:
        """How many concurrent commits each fdatasync made durable (the groups that formed)."""
        group = []
        for path, a, z, data in self.concurrent_commits:
            # The first snapshot after an fdatasync of the file that holds the commit's bytes durably.
            group.append(
                next(
                    i
                    for i, sn in enumerate(self.snaps)
                    if sn.op == f"fdatasync {path}" and sn.fs.durable_bytes(path)[a:z] == data
                )
            )
        return sorted(Counter(group).values())

    def sync(self) -> None:
        self.ch.sync()
        self.durable_upto = len(self.acked)

    def checkpoint(self, durable: bool = False, during: Callable[[], None] | None = None) -> None:
        """A checkpoint; ``during`` runs once the writers are let go, before the data files are synced.

        With ``durable`` (``fsync="interval"``), every commit before the checkpoint began is
        durable once it returns: the checkpoint vouches for the files' lengths as it froze them.
        """
        if not hasattr(self.ch, "checkpoint"):
            return
        before = len(self.acked)
        log = self.ch._log
        if during is not None:
            plain = log.make_durable

            def hooked(frozen: Any) -> None:
                during()  # committers go on while the checkpoint's syncs are still to come
                plain(frozen)

            log.make_durable = hooked  # type: ignore[method-assign]
        try:
            self.ch.checkpoint()
        finally:
            if during is not None:
                del log.make_durable
        if durable:
            self.durable_upto = max(self.durable_upto, before)

    def anchor(self) -> None:
        """An encrypted channel's ANCHOR refresh (``anchor_interval``'s step): it makes everything durable first."""
        assert self.ch._log.refresh_anchor()
        self.durable_upto = len(self.acked)

    def reopen(self) -> None:
        self.inflight = self._ack_effect()  # close applies acknowledgements
        self.ch.close()
        self._applied()
        self.durable_upto = len(self.acked)
        self.ch = filechannel.open(DIR, fs=self.fs, **self.opts)
        assert self.ch.stats()["acked_events_taken"] == 0  # close applied them all

    # -- an external consumer (what a ChannelReader in another process writes) --------

    def _store(self) -> ConsumerStore:
        return ConsumerStore(self.fs, DIR)

    def register(self, start: int) -> None:
        self.acks = frozenset({None, start})
        self._store().register(CONSUMER, "query-1", start)
        self.acks = frozenset({start})
        self.ack_mark = start

    def ack(self, end: int) -> None:
        assert self.ack_mark is not None
        self.acks = frozenset({self.ack_mark, end})
        self.ack_mark = self._store().ack(CONSUMER, "query-1", end)
        self.acks = frozenset({self.ack_mark})

    def remove_consumer(self) -> None:
        self.acks = frozenset({self.ack_mark, None})
        assert self._store().remove(CONSUMER)
        self.acks = frozenset({None})
        self.ack_mark = None

    def _ack_effect(self) -> Effect | None:
        if self.ack_mark is None:
            return None
        return Effect(takes=[p for p, _ in self.queue if p < self.ack_mark])

    def _applied(self) -> None:
        eff, self.inflight = self.inflight, None
        if eff is not None and eff.takes:
            self.acked.append(eff)
            self.queue = apply_effects(self.acked)

    def ack_while_closed(self, end: int) -> None:
        """Close the channel, acknowledge with no owner running, open it again (the open applies it)."""
        self.inflight = self._ack_effect()
        self.ch.close()
        self._applied()
        self.durable_upto = len(self.acked)
        self.ack(end)
        self.inflight = self._ack_effect()
        self.ch = filechannel.open(DIR, fs=self.fs, **self.opts)
        assert self.ch.stats()["acked_events_taken"] == (len(self.inflight.takes) if self.inflight else 0)
        self._applied()

    def apply_acks(self) -> None:
        self.inflight = self._ack_effect()
        n = self.ch.apply_acks()
        assert n == (len(self.inflight.takes) if self.inflight is not None else 0)
        self._applied()

    def finish(self) -> list[Snap]:
        self.ch.close()
        self.fs.on_op = None
        return self.snaps


# --------------------------------------------------------------------------
# recovering and checking


def state_key(fs: SimFS) -> str:
    h = hashlib.blake2b(digest_size=16)
    for path, data in sorted(fs.files("/").items()):
        h.update(path.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
    return h.hexdigest()


def drain(ch: filechannel.FileChannel) -> list[tuple[int, bytes]]:
    """Read the whole queue without changing it (take all, roll back)."""
    tx = ch.transaction()
    try:
        evs = tx.take_batch(ch.config.transaction_capacity)
    except filechannel.ConsumerConflictError:
        # Takes are refused while an external consumer is registered: read the queue as they would.
        tx.rollback()
        with ch._lock:
            entries = list(ch._queue)
        return [(e[0], read_event(ch._log, e)[0]) for e in entries]
    tx.rollback()
    return [(e.position, e.body) for e in evs]


def durable_ack(fs: SimFS) -> int | None:
    """CONSUMER's acknowledgement as the (crashed) file system holds it, or None."""
    st = ConsumerStore(fs, DIR).get(CONSUMER)
    return None if st is None else st.acked


def recover(fs: SimFS, opts: dict[str, Any]) -> State:
    ch = filechannel.open(DIR, fs=fs, **opts)
    try:
        return drain(ch), ch.marks()
    finally:
        ch.close()


def place(
    unplaced: tuple[tuple[bytes, ...], ...], marks: tuple[dict[str, bytes], ...], got: list[tuple[int, bytes]]
) -> list[Effect]:
    """The commits in flight that recovery shows, at the positions it shows them: all of each, or none."""
    where = {b: p for p, b in got}
    out = []
    for bodies, tx_marks in zip(unplaced, marks, strict=True):
        seen = [b for b in bodies if b in where]
        assert seen in ([], list(bodies)), f"a commit in flight came back in part: {seen} of {list(bodies)}"
        if seen:
            first = where[bodies[0]]
            assert [where[b] for b in bodies] == list(range(first, first + len(bodies))), "positions not consecutive"
            out.append(Effect(puts=[(first + i, b) for i, b in enumerate(bodies)], marks=tx_marks, order=first))
    return out


def allowed_states(snap: Snap, mode: str, placed: list[Effect] = ()) -> list[State]:  # type: ignore[assignment]
    acked = list(snap.acked) + list(placed)
    if mode == "commit":
        out = [state_of(acked)]
        if snap.inflight is not None:
            out.append(state_of([*acked, snap.inflight]))
        return out
    # interval: any prefix that keeps what sync() made durable
    full = [*acked, snap.inflight] if snap.inflight is not None else acked
    return [state_of(full[:k]) for k in range(snap.durable_upto, len(full) + 1)]


def assert_no_plaintext(fs: SimFS, opts: dict[str, Any]) -> None:
    """With encryption on, no event body or mark key appears in any file (torn tails and checkpoints included)."""
    if opts.get("encryption") is None:
        return
    for path, data in fs.files("/").items():
        # A body's whole tag, not 3 bytes: checkpoints and ANCHOR now hold random bytes (salts' key
        # checks, batch tags, MACs) where a short needle turns up by chance now and then.
        assert re.search(rb"ev\d{4}:[A-Z]", data) is None, f"an event body in plaintext in {path}"
        assert b"after-crash" not in data, f"an event body in plaintext in {path}"
        assert b"producer:" not in data, f"a mark key in plaintext in {path}"  # w_marks, concurrent marks
        assert b"tail:/var/log/" not in data, f"a mark key in plaintext in {path}"


def check_crash_state(crashed: SimFS, snap: Snap, opts: dict[str, Any], nested: bool) -> None:
    mode = opts.get("fsync", "commit")
    assert_no_plaintext(crashed, opts)
    allowed = allowed_states(snap, mode)
    ack = durable_ack(crashed)
    assert ack in snap.acks, f"the ack file holds {ack}, expected one of {set(snap.acks)} after {snap.op}"
    if ack is not None:
        # Recovery applies a durable acknowledgement that was not applied yet.
        allowed = [([(p, b) for p, b in q if p >= ack], m) for q, m in allowed]
    # 1. recover, recording the recovery itself so we can crash inside it
    rec_snaps: list[SimFS] = []
    if nested:
        crashed.on_op = lambda op, path: rec_snaps.append(crashed.snapshot()) if op in MUTATING_OPS else None
    pristine = crashed.snapshot() if nested else None
    got = recover(crashed, opts)
    crashed.on_op = None
    if snap.unplaced:  # commits of concurrent committers in flight: where recovery put them, if it did
        assert mode == "commit"
        assert ack is None
        allowed = allowed_states(snap, mode, place(snap.unplaced, snap.unplaced_marks, got[0]))
    assert got in allowed, f"recovered {got}\nallowed {allowed}\nafter {snap.op}"
    # 2. a clean reopen shows the same, and a new commit gets a fresh position
    ch = filechannel.open(DIR, fs=crashed, **opts)
    try:
        assert (drain(ch), ch.marks()) == got
        with ch.transaction() as tx:
            tx.put(b"after-crash")
        again = drain(ch)
        assert again[:-1] == got[0]
        assert ch.marks() == got[1]
        fresh = again[-1][0]
        assert again[-1][1] == b"after-crash"
        assert fresh >= max((p + 1 for p, _ in got[0]), default=0)
        # Positions of acknowledged commits are never handed out again (with
        # fsync="interval", only those made durable by sync() are promised).
        durable = list(snap.acked) if mode == "commit" else list(snap.acked)[: snap.durable_upto]
        used = next_pos(durable)
        assert fresh >= used, f"position {fresh} reused (acknowledged commits used up to {used - 1})"
    finally:
        ch.close()
    assert_no_plaintext(crashed, opts)
    # 3. crash during recovery, then recover again: the same state
    if nested:
        assert pristine is not None
        for rs in rec_snaps:
            for vmode, seed in NESTED_VARIANTS:
                again_fs = rs.crash(seed, vmode)
                TOTALS["nested_states"] += 1
                assert recover(again_fs, opts) == got, f"recovery is not idempotent (crash during {snap.op})"


def run_crash_points(
    workload: Callable[[Driver], None], opts: dict[str, Any], dir_model: str = "posix", sync_delay: float = 0.0
) -> int:
    fs = ConcurrentSimFS(dir_model=dir_model, sync_delay=sync_delay) if sync_delay else SimFS(dir_model=dir_model)
    d = Driver(fs, opts)
    workload(d)
    snaps = d.finish()
    if d.concurrent_commits:
        sizes = d.group_sizes()
        TOTALS["concurrent_commits"] += len(d.concurrent_commits)
        TOTALS["groups"] += len(sizes)
        TOTALS["grouped_commits"] += sum(n for n in sizes if n > 1)
        print(f"\n{workload.__name__}: {len(d.concurrent_commits)} concurrent commits in groups of {sizes}")
        # Groups of more than one commit formed, or the run proved nothing about grouped committers.
        assert sum(n > 1 for n in sizes) >= 2, sizes
    seen: set[str] = set()
    checked = 0
    for i, snap in enumerate(snaps):
        TOTALS["snapshots"] += 1
        for j, (vmode, seed) in enumerate(VARIANTS):
            crashed = snap.fs.crash(seed * 7919 + i, vmode)
            TOTALS["variants"] += 1
            # The same bytes must be checked again when the oracle differs.
            key = (
                f"{state_key(crashed)}/{len(snap.acked)}/{snap.inflight is not None}/{snap.durable_upto}/"
                f"{sorted(snap.acks, key=str)}/{sorted(u[0] for u in snap.unplaced)}/"
                f"{sorted(apply_marks(list(snap.acked)).items())}"
            )
            if key in seen:
                continue
            seen.add(key)
            checked += 1
            TOTALS["distinct_states"] += 1
            check_crash_state(crashed, snap, opts, nested=(j % 4 == 0))
    return checked


# --------------------------------------------------------------------------
# the workloads


def w_basic(d: Driver) -> None:
    d.txn(puts=[200, 300, 100])
    d.txn(takes=2)
    d.txn(puts=[150, 150], commit=False)
    d.txn(puts=[120], takes=1)


def w_roll_and_retire(d: Driver) -> None:
    d.txn(puts=[900, 900, 900])
    d.txn(puts=[900, 900])  # rolls to a second file
    d.txn(takes=4, commit=False)
    d.txn(takes=5)  # empties the first file: retired inline
    d.txn(puts=[700])


def w_take_only_opens(d: Driver) -> None:
    # Short-lived opens that only take, while the head file still holds events: each writes its
    # takes into a file of TAKE records only, which retires as the channel closes (the takes of
    # the files that stay written again first, and the open after a checkpoint does not know
    # which files those TAKE records took from). No crash point brings a taken event back.
    d.txn(puts=[300, 300, 300, 300, 300])
    d.reopen()
    d.txn(takes=1)
    d.reopen()
    d.txn(takes=1)
    d.reopen()
    d.txn(takes=2)
    d.reopen()


def w_reopen_and_rollbacks(d: Driver) -> None:
    d.txn(puts=[300, 301])
    d.reopen()
    d.txn(takes=1, commit=False)
    d.txn(takes=2)
    d.txn(puts=[64, 65, 66])


def w_checkpoint(d: Driver) -> None:
    d.txn(puts=[1000, 1000, 1000])
    d.checkpoint()
    d.txn(takes=2, puts=[1000])
    d.txn(puts=[1500])  # roll
    d.checkpoint()
    d.txn(takes=3)


def w_interval(d: Driver) -> None:
    d.txn(puts=[200, 200])
    d.txn(puts=[300])
    d.sync()
    d.txn(takes=2)
    d.txn(puts=[900, 900, 900, 900])  # rolls
    d.txn(takes=1, puts=[50])


def w_anchor(d: Driver) -> None:
    # ANCHOR refreshed between checkpoints (encrypted channels, anchor_interval): its writes are
    # persistence points too, and a crash at any of them loses nor refuses nothing.
    d.txn(puts=[300, 300])
    d.anchor()
    d.txn(takes=1, puts=[900, 900, 900])  # rolls
    d.anchor()
    d.txn(takes=2)
    d.anchor()


def w_upgrade_data_dirs(d: Driver) -> None:
    # A channel written by 0.1: DATA_DIRS of version 1 (absolute paths), no DATADIR identity.
    # The next open upgrades both (the crash points of that upgrade are recorded too).
    d.txn(puts=[300, 300])
    d.ch.close()
    d.fs.write(DIR + "/DATA_DIRS", json.dumps({"data_dirs": [DIR + "/data"]}).encode())
    d.fs.remove(DIR + "/data/DATADIR")
    d.ch = filechannel.open(DIR, fs=d.fs, **d.opts)
    d.txn(takes=1, puts=[200])


def w_consumer_acks(d: Driver) -> None:
    # An external consumer registers, acknowledges, and the owner turns its acks into takes:
    # by apply_acks(), by close() (an ack written while the owner runs), by open (an ack written
    # while no owner ran), and not after an unregistration.
    d.txn(puts=[900, 900, 900])
    d.txn(puts=[900, 900])  # rolls to a second file
    d.register(start=0)  # consumers/ created, q.ack written
    d.ack(2)
    d.apply_acks()  # a take-only commit of positions 0, 1
    d.ack(4)  # written, not applied: close applies it, and the first file retires
    d.reopen()
    d.txn(puts=[300, 300])
    d.ack_while_closed(6)
    d.ack(7)  # written, never applied: the consumer is removed first
    d.remove_consumer()
    d.txn(takes=1)  # in-process takes work again


def w_concurrent(d: Driver) -> None:
    # Several threads commit at once; their commits share writes and fdatasyncs (groups),
    # marks included.
    d.txn(puts=[200])
    # With marks: each thread's own key, and one key all of them set (the last commit's wins).
    d.concurrent(threads=4, txns=3, puts=[150, 150], rollback=frozenset({(1, 1)}), marks=True)  # a roll at 4 KiB
    d.txn(takes=4)
    d.checkpoint()
    d.concurrent(threads=3, txns=2, puts=[900], marks=True)  # rolls inside groups
    d.txn(takes=3, puts=[100])


def w_concurrent_anchors(d: Driver) -> None:
    # Committers at once while ANCHOR is refreshed over and over (encrypted channels'
    # anchor_interval), across file rolls: no crash state may be refused at the next open.
    d.txn(puts=[200])
    d.concurrent(threads=4, txns=3, puts=[150, 150], anchors=True)
    d.txn(takes=4)
    d.concurrent(threads=3, txns=2, puts=[900], anchors=True)  # rolls inside groups


def w_one_event(d: Driver) -> None:
    # One-event transactions, the writer's lone-committer path (one framing call, one write),
    # with and without headers, across a file roll and a reopen; then concurrent one-event
    # committers: a lone committer's write with others queueing behind it (it leads on).
    for n in (200, 201, 300):  # an odd size carries a header
        d.txn(puts=[n])
    d.txn(takes=2)
    d.txn(puts=[900], commit=False)
    for n in (900, 901, 900, 900):  # rolls to a second file (max_file_size=4096)
        d.txn(puts=[n])
    d.reopen()
    d.txn(puts=[64])
    d.concurrent(threads=4, txns=3, puts=[150])
    d.txn(takes=3)
    d.concurrent(threads=3, txns=2, puts=[700])  # rolls inside groups
    d.txn(puts=[100])


def w_marks(d: Driver) -> None:
    # Marks commit with their transaction's events (and alone), survive a rollback of a later
    # change, the retirement of the data file that holds them (re-logged first), checkpoints
    # and reopens.
    d.txn(puts=[200, 300], marks={"producer:a": b"1"})
    d.txn(marks={"tail:/var/log/x": b"100"})  # marks alone
    d.txn(puts=[150], marks={"producer:a": b"2"}, commit=False)
    d.txn(puts=[900, 900, 900], marks={"producer:b": b"1"})
    d.txn(puts=[900, 900], marks={"producer:a": b"3"})  # rolls to a second file
    retired = d.ch.stats()["files_retired"]
    d.txn(takes=5)  # empties the first file: its marks are re-logged, then it retires
    assert d.ch.stats()["files_retired"] >= retired + 1
    d.checkpoint()
    d.txn(puts=[100], marks={"producer:b": b"2", "tail:/var/log/x": b"200"})
    d.reopen()
    retired = d.ch.stats()["files_retired"]
    d.txn(takes=3, marks={"producer:a": b"4"})  # empties the second file: retired in turn
    assert d.ch.stats()["files_retired"] >= retired + 1


def w_arrow(d: Driver) -> None:
    # Transactions put through put_arrow: a column framed in one call (into the writer's reused
    # frame buffer), alone, after a rollback, with takes, mixed with put() in one transaction,
    # across a file roll and a reopen.
    d.txn(puts=[200, 300, 100], arrow=3)
    d.txn(puts=[150, 150], arrow=2, commit=False)
    d.txn(puts=[900, 900, 900], arrow=3, takes=2)  # rolls to a second file
    d.txn(puts=[120, 121, 64], arrow=2)  # put_arrow, then put() (with headers) in the same transaction
    d.reopen()
    d.txn(puts=[700, 10], arrow=2, takes=3)


def w_concurrent_arrow(d: Driver) -> None:
    # Committers putting through put_arrow at once: their columns share writes and fdatasyncs.
    d.txn(puts=[200], arrow=1)
    d.concurrent(threads=4, txns=3, puts=[150, 150], rollback=frozenset({(2, 1)}), arrow=True)
    d.txn(takes=5)
    d.concurrent(threads=3, txns=2, puts=[900], arrow=True)  # rolls inside groups


def w_runs(d: Driver) -> None:
    # The queue as runs and the checkpoint of runs (version 6): committers at once (one run per
    # data file, or per transaction with two data directories) while checkpoints are written,
    # takes rolled back (their entries return to the head and are checkpointed there), and a
    # reopen from a checkpoint (cold runs, found again by scanning the data files forward).
    d.txn(puts=[200, 200, 200])
    d.concurrent(threads=6, txns=2, puts=[150, 150], rollback=frozenset({(2, 1)}), checkpoints=2)
    d.txn(takes=4, commit=False)  # back to the head, the first run's and a concurrent one's
    d.txn(takes=1)
    d.checkpoint()  # runs plus the rolled-back entries at the head
    d.concurrent(threads=4, txns=2, puts=[900], checkpoints=2)  # rolls inside groups
    d.txn(takes=6, commit=False)
    d.reopen()  # from the checkpoint the close wrote
    d.txn(takes=5, commit=False)
    d.txn(takes=3, puts=[100])
    d.checkpoint()
    d.txn(takes=4)


def w_interval_checkpoints(d: Driver) -> None:
    # fsync="interval": a checkpoint reads the files' lengths with the writers held, then syncs the
    # files to them while commits go on (one lands in between, here), and only then vouches for
    # them; every commit before it began is durable once it returns, across a roll and a reopen.
    d.txn(puts=[200, 200])
    d.txn(puts=[300], takes=1)
    d.checkpoint(durable=True, during=lambda: d.txn(puts=[150, 151]))
    d.txn(takes=2, puts=[900, 900, 900])  # rolls
    d.checkpoint(durable=True, during=lambda: d.txn(takes=1, puts=[900]))  # rolls while it syncs
    d.txn(puts=[60])
    d.reopen()
    d.txn(takes=1, puts=[70])
    d.checkpoint(durable=True)


COMMIT = dict(BASE_OPTS)
INTERVAL = dict(BASE_OPTS, fsync="interval", fsync_interval=3600.0)


def _encryption() -> Any:
    try:
        import cryptography  # noqa: F401
    except ImportError:  # pragma: no cover - the crypto extra is installed by scripts/test.sh
        return None
    return filechannel.Encryption(keys={"k1": bytes(range(32))}, active_key="k1")


ENCRYPTION = _encryption()
ENC_MARKS = [pytest.mark.skipif(ENCRYPTION is None, reason="the crypto extra is not installed")]

CASES = [
    pytest.param(w_basic, COMMIT, "posix", 40, id="basic-posix"),
    pytest.param(w_basic, COMMIT, "ext4", 20, id="basic-ext4"),
    pytest.param(w_roll_and_retire, COMMIT, "posix", 60, id="roll-retire-posix"),
    pytest.param(w_reopen_and_rollbacks, COMMIT, "posix", 40, id="reopen-rollback-posix"),
    pytest.param(w_take_only_opens, COMMIT, "posix", 60, id="take-only-opens-posix"),
    pytest.param(w_take_only_opens, INTERVAL, "posix", 40, id="take-only-opens-interval-posix"),
    pytest.param(w_checkpoint, COMMIT, "posix", 40, id="checkpoint-posix"),
    pytest.param(w_interval_checkpoints, INTERVAL, "posix", 60, id="interval-checkpoints-posix"),
    pytest.param(w_interval_checkpoints, INTERVAL, "ext4", 40, id="interval-checkpoints-ext4"),
    pytest.param(
        w_interval_checkpoints,
        dict(INTERVAL, encryption=ENCRYPTION),
        "posix",
        60,
        id="encrypted-interval-checkpoints-posix",
        marks=ENC_MARKS,
    ),
    pytest.param(w_interval, INTERVAL, "posix", 40, id="interval-posix"),
    pytest.param(w_basic, dict(COMMIT, data_dirs=["/sim/disk2"]), "posix", 40, id="external-data-dir-posix"),
    pytest.param(w_upgrade_data_dirs, COMMIT, "posix", 30, id="upgrade-data-dirs-posix"),
    pytest.param(w_marks, COMMIT, "posix", 60, id="marks-posix"),
    pytest.param(w_marks, COMMIT, "ext4", 40, id="marks-ext4"),
    pytest.param(w_marks, INTERVAL, "posix", 60, id="marks-interval-posix"),
    pytest.param(
        w_marks, dict(COMMIT, encryption=ENCRYPTION), "posix", 60, id="encrypted-marks-posix", marks=ENC_MARKS
    ),
    pytest.param(w_consumer_acks, COMMIT, "posix", 200, id="consumer-acks-posix"),
    pytest.param(w_arrow, COMMIT, "posix", 60, id="arrow-posix"),
    pytest.param(w_arrow, COMMIT, "ext4", 40, id="arrow-ext4"),
    pytest.param(w_arrow, INTERVAL, "posix", 40, id="arrow-interval-posix"),
    pytest.param(
        w_arrow, dict(COMMIT, encryption=ENCRYPTION), "posix", 60, id="encrypted-arrow-posix", marks=ENC_MARKS
    ),
    pytest.param(w_consumer_acks, COMMIT, "ext4", 150, id="consumer-acks-ext4"),
    # Encryption on: every new file gets a new salt and key; a torn tail is set aside as ciphertext.
    pytest.param(
        w_roll_and_retire,
        dict(COMMIT, encryption=ENCRYPTION),
        "posix",
        60,
        id="encrypted-roll-retire-posix",
        marks=ENC_MARKS,
    ),
    pytest.param(
        w_interval, dict(INTERVAL, encryption=ENCRYPTION), "posix", 40, id="encrypted-interval-posix", marks=ENC_MARKS
    ),
    pytest.param(
        w_anchor, dict(COMMIT, encryption=ENCRYPTION), "posix", 60, id="encrypted-anchor-posix", marks=ENC_MARKS
    ),
    pytest.param(
        w_anchor,
        dict(INTERVAL, encryption=ENCRYPTION),
        "posix",
        40,
        id="encrypted-anchor-interval-posix",
        marks=ENC_MARKS,
    ),
]


@pytest.mark.parametrize(("workload", "opts", "dir_model", "minimum"), CASES)
def test_crash_at_every_persistence_point(
    workload: Callable[[Driver], None], opts: dict[str, Any], dir_model: str, minimum: int
) -> None:
    checked = run_crash_points(workload, opts, dir_model)
    print(f"\n{workload.__name__}/{dir_model}: {checked} distinct crash states recovered and checked")
    assert checked >= minimum


SYNC_DELAY = 0.003  # seconds each simulated fdatasync takes: long enough for committers to queue behind it


@pytest.mark.parametrize(
    ("opts", "dir_model", "minimum"),
    [
        pytest.param(COMMIT, "posix", 150, id="posix"),
        pytest.param(COMMIT, "ext4", 100, id="ext4"),
        pytest.param(dict(COMMIT, encryption=ENCRYPTION), "posix", 150, id="encrypted-posix", marks=ENC_MARKS),
    ],
)
def test_crash_points_with_concurrent_committers(opts: dict[str, Any], dir_model: str, minimum: int) -> None:
    """Grouped commits: a crash at any call, or just as any commit returns, keeps every commit that returned."""
    checked = run_crash_points(w_concurrent, opts, dir_model, sync_delay=SYNC_DELAY)
    print(f"w_concurrent/{dir_model}: {checked} distinct crash states recovered and checked")
    assert checked >= minimum


@pytest.mark.skipif(ENCRYPTION is None, reason="the crypto extra is not installed")
def test_crash_points_with_concurrent_committers_and_anchor_refreshes() -> None:
    """ANCHOR refreshed while commits group: a crash anywhere keeps every commit that returned, never refuses."""
    opts = dict(COMMIT, encryption=ENCRYPTION)
    checked = run_crash_points(w_concurrent_anchors, opts, "posix", sync_delay=SYNC_DELAY)
    print(f"w_concurrent_anchors/posix: {checked} distinct crash states recovered and checked")
    assert checked >= 100


@pytest.mark.parametrize(
    ("opts", "dir_model", "minimum"),
    [
        pytest.param(COMMIT, "posix", 100, id="posix"),
        pytest.param(dict(COMMIT, encryption=ENCRYPTION), "posix", 100, id="encrypted-posix", marks=ENC_MARKS),
    ],
)
def test_crash_points_with_concurrent_arrow_committers(opts: dict[str, Any], dir_model: str, minimum: int) -> None:
    """Grouped commits of put_arrow columns: a crash anywhere keeps every commit that returned, and only those."""
    checked = run_crash_points(w_concurrent_arrow, opts, dir_model, sync_delay=SYNC_DELAY)
    print(f"w_concurrent_arrow/{dir_model}: {checked} distinct crash states recovered and checked")
    assert checked >= minimum


@pytest.mark.parametrize("dir_model", ["posix", "ext4"])
def test_crash_points_of_one_event_transactions(dir_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One-event transactions take the writer's lone-committer path; every crash point keeps what returned."""
    written = []
    plain = Writer._write_commit1

    def spy(self: Writer, it: Any) -> None:
        written.append(it.txn_id)
        plain(self, it)

    monkeypatch.setattr(Writer, "_write_commit1", spy)
    checked = run_crash_points(w_one_event, COMMIT, dir_model, sync_delay=SYNC_DELAY)
    print(f"w_one_event/{dir_model}: {checked} distinct crash states recovered and checked")
    # The path under test ran: at least the five single-threaded one-event commits that neither
    # start a file nor roll one (those take the general path), and some of the concurrent ones.
    assert len(written) >= 6
    assert checked >= 100


@pytest.mark.parametrize(
    ("opts", "minimum"),
    [
        pytest.param(COMMIT, 150, id="plain-one-dir"),
        pytest.param(dict(COMMIT, data_dirs=["/sim/d1", "/sim/d2"]), 150, id="plain-two-dirs"),
        pytest.param(dict(COMMIT, encryption=ENCRYPTION), 150, id="encrypted-one-dir", marks=ENC_MARKS),
        pytest.param(
            dict(COMMIT, encryption=ENCRYPTION, data_dirs=["/sim/d1", "/sim/d2"]),
            150,
            id="encrypted-two-dirs",
            marks=ENC_MARKS,
        ),
    ],
)
def test_crash_points_of_the_run_queue(opts: dict[str, Any], minimum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run-based queue and checkpoints of runs, crashed everywhere with committers at once and rolled-back takes.

    Record pointers are kept for two events only and found two at a time, so the head is read by
    scanning data files forward (``Log.locate_puts``) here as it is at depth.
    """
    plain = RunQueue.__init__

    def few_pointers(self: RunQueue, locate: Any, hot_pointers: int = 0, chunk: int = 0) -> None:
        plain(self, locate, 2, 2)

    monkeypatch.setattr(RunQueue, "__init__", few_pointers)
    located: list[int] = []
    plain_locate = Log.locate_puts

    def spy(self: Log, *args: Any, **kwargs: Any) -> Any:
        located.append(1)
        return plain_locate(self, *args, **kwargs)

    monkeypatch.setattr(Log, "locate_puts", spy)
    written: list[int] = []
    plain_encode = checkpoint.encode_blocks

    def spy_encode(s: Any, *args: Any, **kwargs: Any) -> Any:
        written.append(6 if s.runs is not None else 5)
        return plain_encode(s, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "encode_blocks", spy_encode)
    checked = run_crash_points(w_runs, opts, "posix", sync_delay=SYNC_DELAY)
    kind = f"{'encrypted' if opts.get('encryption') else 'plain'}, {len(opts.get('data_dirs', [1]))} data dir(s)"
    print(f"w_runs ({kind}): {checked} distinct crash states recovered and checked")
    assert located, "the head was never found by scanning a data file"
    assert written, "no checkpoint was written"
    assert set(written) == {6}, f"checkpoints of versions {set(written)}, not only version 6"
    assert checked >= minimum


def test_crash_points_of_checkpoints_written_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint workload with tiny blocks: every block write, flush and shrinking step is a crash point."""
    from filechannel import checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK", 64)
    monkeypatch.setattr(checkpoint, "SYNC_EVERY", 128)
    monkeypatch.setattr(checkpoint, "SHRINK_STEP", 64)
    checked = run_crash_points(w_checkpoint, COMMIT, "posix")
    print(f"\nw_checkpoint in blocks: {checked} distinct crash states recovered and checked")
    assert checked >= 40


def test_zz_report_totals() -> None:
    """Print the totals of this module's run (pytest -s shows them)."""
    print(
        f"\ncrash points: {TOTALS['snapshots']} snapshots x {len(VARIANTS)} variants = {TOTALS['variants']} "
        f"crash states, {TOTALS['distinct_states']} distinct recovered and checked, "
        f"{TOTALS['nested_states']} crashes during recovery; {TOTALS['concurrent_commits']} concurrent commits "
        f"in {TOTALS['groups']} groups, {TOTALS['grouped_commits']} of them in groups of more than one"
    )
