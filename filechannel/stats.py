"""The keys of ``FileChannel.stats()``, typed: what a dashboard or a test can rely on.

This module owns the names and types only (docs/stats.md says what each
means; ``tests/test_stats_keys.py`` keeps the three in step). It imports
nothing of the channel.
"""

from __future__ import annotations

from typing import TypedDict


class ConsumerStats(TypedDict):
    """One registered external consumer, as ``stats()["consumers"][name]`` shows it."""

    acked: int
    lag_events: int
    identity: str | None
    oldest_file: str | None


class ChannelStats(TypedDict):
    """What :meth:`filechannel.FileChannel.stats` returns."""

    # counters since this open
    puts_attempted: int
    puts_committed: int
    takes_attempted: int
    takes_committed: int
    transactions_committed: int
    rollbacks: int
    commit_failures: int
    channel_full: int
    cache_hits: int
    disk_reads: int
    damaged_events_dropped: int
    acked_events_taken: int
    # the queue now
    queue_size: int
    inflight_puts: int
    inflight_takes: int
    capacity: int
    next_position: int
    head_position: int | None
    cache_events: int
    cache_bytes: int
    queue_memory_bytes: int
    open_transactions: int
    # how this open went
    replay_seconds: float
    failed: bool
    recovery_source: str
    accelerator: str
    checkpoint_fallbacks: int
    key_ids_in_use: list[str]
    # external consumers
    consumers: dict[str, ConsumerStats]
    consumers_problem: str | None
    # checkpoints since this open
    checkpoints_written: int
    checkpoint_failures: int
    last_checkpoint_woid: int | None
    last_checkpoint_seconds: float | None
    last_checkpoint_bytes: int | None
    last_checkpoint_time: float | None
    # the log
    fsyncs: int
    fsync_seconds: float
    fsync_seconds_buckets: list[list[str | int]]
    bytes_written: int
    files: int
    files_created: int
    files_retired: int
    disk_bytes: int
    data_bytes: int
    max_bytes: int | None
    disk_free: int | None
    minimum_required_space: int
    space_refusals: int
    last_woid: int
    # damage
    torn_tails_truncated: int
    corruptions_skipped: int
    lost_positions: list[list[int]]
    corruption_report: list[str]
