"""A streaming query for the stream_test tests (imported by the driver subprocess as ``stream_queries``).

The worked example's ``foreachBatch`` jobs live in docs/testing.md; this one is
Spark's own Parquet file sink, which ``CrashDriver(at="after_sink")`` cannot cut.
"""

from __future__ import annotations

from typing import Any


def file_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """Read the channel into Spark's Parquet file sink (exactly once through its metadata log)."""
    events = spark.readStream.format("filechannel").option("consumer", "stream-test").load(channel_dir)
    return events.select("position", "body").writeStream.format("parquet").start(output_dir)


def failing_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """A foreachBatch sink that fails on its first batch."""

    def write(df: Any, batch_id: int) -> None:
        raise ValueError(f"boom: batch {batch_id} holds {df.count()} rows")

    events = spark.readStream.format("filechannel").option("consumer", "stream-test").load(channel_dir)
    return events.writeStream.foreachBatch(write).start()
