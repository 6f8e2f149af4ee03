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


def batch_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """An idempotent foreachBatch sink: batch N overwrites ``output_dir/batch=N`` (replays write the same rows)."""
    import os

    def write(df: Any, batch_id: int) -> None:
        df.select("position", "body").write.mode("overwrite").parquet(os.path.join(output_dir, f"batch={batch_id}"))

    events = spark.readStream.format("filechannel").option("consumer", "stream-test").load(channel_dir)
    return events.writeStream.foreachBatch(write).start()


def rows_of(spark: Any, output_dir: str) -> list[dict[str, Any]]:
    """``read_output`` returning a list (not a DataFrame): every row the batch sink wrote."""
    import os

    if not os.path.isdir(output_dir) or not os.listdir(output_dir):
        return []
    return [r.asDict() for r in spark.read.parquet(output_dir).select("position", "body").collect()]
