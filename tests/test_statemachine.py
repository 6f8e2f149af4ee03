"""Model-based test: random sequences of channel operations, crashes and damage vs a reference model.

Rules: put, take, commit, rollback, a large put that rolls the data file,
checkpoint, a power cut (any SimFS crash mode) and reopen, a clean reopen, and
a flipped byte in a closed older data file (which must be refused, then is
repaired). The model is the queue of committed events (position, body) plus
the open transaction's puts and takes. With ``fsync="commit"`` and no commit in
flight, a crash must lose nothing, so after every step the channel must equal
the model exactly: the same events, bodies and positions.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from simfs import CRASH_MODES, SimFS

import filechannel

DIR = "/sim/ch"
OPTS: dict[str, Any] = {"background": False, "minimum_required_space": 0, "max_file_size": 4096}
STEPS = {"steps": 0, "crashes": 0, "corruptions": 0}


class ChannelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fs = SimFS()
        self.ch = filechannel.open(DIR, fs=self.fs, **OPTS)
        self.queue: list[tuple[int, bytes]] = []
        self.next_pos = 0
        self.tx: filechannel.Transaction | None = None
        self.tx_puts: list[bytes] = []
        self.tx_taken: list[tuple[int, bytes]] = []
        self.n = 0

    # -- helpers ------------------------------------------------------------------

    def _tx(self) -> filechannel.Transaction:
        if self.tx is None:
            self.tx = self.ch.transaction()
        return self.tx

    def _body(self, size: int) -> bytes:
        self.n += 1
        tag = b"e%d;" % self.n
        return tag + b"x" * max(0, size - len(tag))

    def _drop_tx(self) -> None:
        self.tx = None
        self.tx_puts = []
        self.tx_taken = []

    def _reopen(self, fs: SimFS) -> None:
        self.fs = fs
        self.ch = filechannel.open(DIR, fs=fs, **OPTS)

    # -- rules --------------------------------------------------------------------

    @rule(sizes=st.lists(st.integers(0, 600), min_size=1, max_size=4))
    def put(self, sizes: list[int]) -> None:
        tx = self._tx()
        for s in sizes:
            b = self._body(s)
            tx.put(b)
            self.tx_puts.append(b)

    @rule()
    def put_large(self) -> None:
        """An event too big for what is left of the file: the writer rolls at commit."""
        self.put([2500])

    @rule(n=st.integers(1, 5))
    def take(self, n: int) -> None:
        tx = self._tx()
        got = [(e.position, e.body) for e in tx.take_batch(n)]
        held = {p for p, _ in self.tx_taken}
        avail = [e for e in self.queue if e[0] not in held]
        assert got == avail[:n]
        self.tx_taken.extend(got)

    @precondition(lambda self: self.tx is not None)
    @rule()
    def commit(self) -> None:
        assert self.tx is not None
        self.tx.commit()
        taken = {p for p, _ in self.tx_taken}
        self.queue = [e for e in self.queue if e[0] not in taken]
        for b in self.tx_puts:
            self.queue.append((self.next_pos, b))
            self.next_pos += 1
        self._drop_tx()

    @precondition(lambda self: self.tx is not None)
    @rule()
    def rollback(self) -> None:
        assert self.tx is not None
        self.tx.rollback()
        self._drop_tx()

    @rule()
    def checkpoint(self) -> None:
        self.ch.checkpoint()

    @rule(seed=st.integers(0, 2**32 - 1), mode=st.sampled_from(CRASH_MODES))
    def crash_and_reopen(self, seed: int, mode: str) -> None:
        """A power cut: the open transaction is lost; every returned commit survives."""
        STEPS["crashes"] += 1
        crashed = self.fs.crash(seed, mode)
        self.ch.close()  # releases the old in-memory object only; the crash state is fixed
        self._drop_tx()
        self._reopen(crashed)

    @rule()
    def clean_reopen(self) -> None:
        self.ch.close()
        self._drop_tx()
        self._reopen(self.fs)

    @rule(which=st.integers(0, 1000), at=st.integers(0, 1 << 16), bit=st.integers(0, 7))
    def corrupt_a_closed_file(self, which: int, at: int, bit: int) -> None:
        """Flip a bit in an older data file: refused with CorruptLogError; then repaired."""
        self.ch.close()
        self._drop_tx()
        segs = sorted(p for p in self.fs.files(DIR + "/data") if p.endswith(".wal"))
        if len(segs) >= 2:
            path = segs[which % (len(segs) - 1)]
            orig = self.fs.read(path)
            off = 160 + at % max(1, len(orig) - 160)  # past the header and its padding
            if off < len(orig):
                STEPS["corruptions"] += 1
                bad = bytearray(orig)
                bad[off] ^= 1 << bit
                self.fs.write(path, bytes(bad))
                try:
                    ch = filechannel.open(DIR, fs=self.fs, **OPTS, replay="full")
                except filechannel.CorruptLogError:
                    pass
                else:
                    ch.close()
                    raise AssertionError(f"a flipped bit at {path}:{off} was not detected")
                self.fs.write(path, orig)
        self._reopen(self.fs)

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def matches_model(self) -> None:
        STEPS["steps"] += 1
        held = {p for p, _ in self.tx_taken}
        want = [e for e in self.queue if e[0] not in held]
        assert self.ch.size == len(want)
        tx = self.ch.transaction()
        got = [(e.position, e.body) for e in tx.take_batch(self.ch.config.transaction_capacity)]
        tx.rollback()
        assert got == want
        assert not self.ch.stats()["failed"]

    def teardown(self) -> None:
        self.ch.close()


TestChannelMachine = ChannelMachine.TestCase
TestChannelMachine.settings = settings(
    settings.default, max_examples=max(300, settings.default.max_examples), stateful_step_count=50
)


def test_zz_report() -> None:
    print(f"\nstate machine: {STEPS['steps']} steps, {STEPS['crashes']} crashes, {STEPS['corruptions']} corruptions")
