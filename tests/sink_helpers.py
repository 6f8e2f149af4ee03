"""Helpers shared by the sink's tests (``test_spark_sink.py``, ``test_spark_sink_writers.py``).

Nothing here imports PySpark or pyarrow: the commit protocol's tests run without them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import filechannel
from filechannel import ChannelReader, cli
from filechannel._fs import DEFAULT_FS, FS
from filechannel.consumers import ConsumerStore
from filechannel.spark import sink
from filechannel.spark.sink import SinkOptions, stage_events

QUERY = "0b1e7a52-6a55-4c1f-9d07-5a1d2f3c4b5e"
CH_OPTS: dict[str, Any] = {"channel.minimum_required_space": "0", "channel.checkpoint_interval": "0"}
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def options(path: str | Path, **extra: str) -> SinkOptions:
    return SinkOptions.from_spark({"path": str(path), **CH_OPTS, **extra})


def stage(opts: SinkOptions, batch_id: int, bodies: list[bytes], part: int = 0, fs: FS = DEFAULT_FS) -> str:
    """Stage ``bodies`` as one task of ``batch_id`` would; return the staged file's name."""
    name = sink._staged_name(sink.stream_prefix(QUERY, batch_id), part, 0)
    got, rows, _ = stage_events(fs, opts.staging_dir, name, [(b, None) for b in bodies], 1 << 20)
    assert (got, rows) == (name, len(bodies))
    return name


def view(path: str | Path, fs: FS | None = None) -> list[filechannel.Event]:
    """Every committed event still in the channel (a lock-free view)."""
    with ChannelReader(str(path), fs=fs) as v:
        start, end = v.available()
        return v.read(start, end)


def bodies_of(path: str | Path, fs: FS | None = None) -> list[bytes]:
    return [e.body for e in view(path, fs)]


def commit_records(path: str | Path) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["dump", str(path)]) == 0
    return [r for r in map(json.loads, out.getvalue().splitlines()) if r["op"] == "commit" and r["puts"]]


def staged_files(opts: SinkOptions) -> list[str]:
    try:
        return sorted(os.listdir(opts.staging_dir))
    except FileNotFoundError:
        return []


def guards(path: str | Path, fs: FS = DEFAULT_FS) -> list[str]:
    return sorted(n for n in ConsumerStore(fs, str(path)).list() if n.startswith("spark-sink."))
