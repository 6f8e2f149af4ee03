"""``verify_channel``: check a channel without changing it.

This module owns the read-only check behind ``filechannel verify``: the
recovery an open performs (``logview.open_view`` in skip mode: no lock, nothing written),
every queued event read back, the acknowledgements' MACs of an encrypted
channel, and the damage a checkpoint hides (latent).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._fs import DEFAULT_FS, FS
from ._queue import Entry
from .config import ChannelConfig
from .consumers import ConsumerStore
from .errors import CorruptLogError
from .log import CorruptionReport, merge_ranges
from .logview import open_view
from .replay import read_event

__all__ = ["VerifyResult", "verify_channel"]


@dataclass
class VerifyResult:
    """What :func:`verify_channel` found.

    ``reports`` and ``lost_positions`` are exactly what an open with
    ``on_corruption="skip"`` followed by a drain would report: the same code
    path. ``latent`` lists damage behind a checkpoint that costs nothing now
    but would cost events if the checkpoint were lost.
    """

    queued: list[Entry]
    files: int
    reports: list[CorruptionReport]
    latent: list[str]
    torn_tails: list[tuple[str, int, int]]
    recovery_source: str
    undecrypted: int = 0  # queued encrypted events whose checksum was checked but not their tag (no key)
    key_ids: tuple[str, ...] = ()  # key ids of the live encrypted data files

    @property
    def lost_positions(self) -> list[tuple[int, int]]:
        """Every lost position, as merged half-open ranges."""
        return merge_ranges([r for rep in self.reports for r in rep.lost_positions])

    @property
    def ok(self) -> bool:
        """Whether nothing is damaged, lost or latent."""
        return not self.reports and not self.latent


def verify_channel(
    directory: str | os.PathLike[str],
    *,
    fs: FS | None = None,
    backup_checkpoint_dir: str | None = None,
    progress: Callable[[str], None] | None = None,
    encryption: Any = None,
) -> VerifyResult:
    """Check a channel without changing it: the recovery an open performs, plus every queued event.

    Takes no lock and writes nothing, so it runs beside a live channel (it then
    sees the channel as a crash at this instant would leave it). Without
    ``encryption`` (a :class:`filechannel.Encryption`), encrypted events are
    checked by checksum only (``undecrypted`` counts them); with it, every
    queued event's authentication tag is checked too.

    Raises:
        NotAChannelError: ``directory`` is not a channel directory.
        CorruptLogError: Something that decides what is read (``CHANNEL``,
            ``DATA_DIRS``, a data directory identity) is unreadable.
    """
    fs = fs or DEFAULT_FS
    directory = os.fspath(directory)
    cfg = ChannelConfig(on_corruption="skip", backup_checkpoint_dir=backup_checkpoint_dir, encryption=encryption)
    view = open_view(directory, cfg, fs=fs, progress=progress, keyless_ok=True)
    log = view.log
    undecrypted = 0
    try:
        q = view.replay()
        intact: list[Entry] = []
        for i, e in enumerate(q):
            if progress is not None and i and i % 100_000 == 0:
                progress(f"  checked {i} of {len(q)} queued events")
            try:
                if encryption is None and log.is_encrypted(e[1]):
                    log.read_payload(e[1], e[2], e[3], decrypt=False)  # the checksum: no key needed
                    undecrypted += 1
                else:
                    read_event(log, e)
            except CorruptLogError as exc:  # what a take with on_corruption="skip" drops
                log.report_corruption(
                    CorruptionReport(
                        exc.path, exc.offset, f"{exc.reason}; dropped when taken", 0, lost_positions=[(e[0], e[0] + 1)]
                    )
                )
                continue
            intact.append(e)
        files = len(log.file_ids())
        key_ids = tuple(log.key_ids_in_use())
        if log.meta_mac is not None:
            # An encrypted channel's acknowledgements: a forged one would make the owner take unread events.
            acks = ConsumerStore(fs, directory, None, log.meta_mac, log.macs_required, log.consumer_acks)
            for name in acks.names():
                try:
                    acks.get(name)
                except CorruptLogError as exc:
                    log.report_corruption(CorruptionReport(exc.path, exc.offset, exc.reason, 0))
    finally:
        log.close()
    latent: list[str] = []
    if log.recovered_from is not None:
        # Read what the checkpoint let recovery skip: damage there costs nothing now.
        seen = {(r.path, r.offset) for r in log.corruption}
        full = open_view(
            directory,
            ChannelConfig(on_corruption="skip", replay="full", encryption=encryption),
            fs=fs,
            checkpoints=False,
            replay=False,
            keyless_ok=True,
        ).log
        try:
            for rep in full.corruption:
                if (rep.path, rep.offset) not in seen and rep.woid_span is not None:
                    latent.append(f"{rep.path} at byte {rep.offset}: {rep.reason} (covered by the checkpoint now)")
        finally:
            full.close()
    # A checkpoint that does not decode costs a slower open, and protects nothing.
    latent += [
        f"checkpoint {f} (recovery falls back to an older one or a full replay)" for f in log.checkpoint_fallbacks
    ]
    source = "full" if log.recovered_from is None else "checkpoint"
    return VerifyResult(intact, files, list(log.corruption), latent, list(log.torn_tails), source, undecrypted, key_ids)
