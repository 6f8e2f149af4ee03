"""Streaming queries for the stream_test tests (imported by the driver subprocess as ``stream_queries``).

Each is ``function(spark, channel_dir, output_dir)`` and returns a started query
that reads the channel and writes Parquet under ``output_dir`` through ``foreachBatch``.
"""

from __future__ import annotations

from typing import Any


def _events(spark: Any, channel_dir: str) -> Any:
    return spark.readStream.format("filechannel").option("consumer", "stream-test").load(channel_dir)


def idempotent_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """Each batch replaces its own directory ``batch=<id>``: a replayed batch overwrites, never adds."""

    def write(df: Any, batch_id: int) -> None:
        df.select("position", "body").write.mode("overwrite").parquet(f"{output_dir}/batch={batch_id}")

    return _events(spark, channel_dir).writeStream.foreachBatch(write).start()


def appending_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """Each batch appends to one table without recording its batch id: a replayed batch is written twice."""

    def write(df: Any, batch_id: int) -> None:
        df.select("position", "body").write.mode("append").parquet(output_dir)

    return _events(spark, channel_dir).writeStream.foreachBatch(write).start()


def file_sink(spark: Any, channel_dir: str, output_dir: str) -> Any:
    """Spark's own Parquet file sink (exactly once through its metadata log; not a foreachBatch sink)."""
    return _events(spark, channel_dir).select("position", "body").writeStream.format("parquet").start(output_dir)
