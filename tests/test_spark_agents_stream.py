"""stream_test's agent form: ``stream_test(..., agent=True)`` and ``CrashAgent()``.

The query reads the channel through an agent process (``filechannel serve`` on a
loopback port); the agent is SIGKILLed and restarted (with a pause, so the
running query meets it down and holds its position), and every event is in the
file sink once. The module is also the query the driver subprocess imports.
"""

from __future__ import annotations

from typing import Any

import pytest

from filechannel.errors import ConfigError
from filechannel.testing import (
    AddData,
    CheckExactlyOnce,
    CrashAgent,
    CrashDriver,
    ProcessAllAvailable,
    StartStream,
    StreamTestError,
    stream_test,
)


def agent_file_sink(spark: Any, uri: str, output_dir: str) -> Any:
    """Read the agent's channel into Spark's Parquet file sink."""
    assert uri.startswith("grpc://127.0.0.1:"), uri
    events = (
        spark.readStream.format("filechannel")
        .option("consumer", "stream-test")
        .option("agents", uri)
        .option("agentTimeoutMs", "2000")
        .load()
    )
    return (
        events.select("position", "body")
        .writeStream.format("parquet")
        .trigger(processingTime="0.5 seconds")
        .start(output_dir)
    )


@pytest.mark.spark
@pytest.mark.slow
def test_crash_agent_mid_stream_is_exactly_once() -> None:
    result = stream_test(
        agent_file_sink,
        [
            AddData([b"a-%d" % i for i in range(20)]),
            StartStream(),
            ProcessAllAvailable(),
            CrashAgent(down=3.0),  # the query runs on meanwhile, its channel held
            AddData([b"b-%d" % i for i in range(20)]),
            ProcessAllAvailable(),
            CrashAgent(),
            CrashDriver(),
            AddData([b"c-%d" % i for i in range(5)]),
            StartStream(),
            ProcessAllAvailable(),
            CheckExactlyOnce(),
        ],
        agent=True,
        timeout=240,
    )
    assert result.agent_crashes == 2
    assert result.driver_crashes == ["now"]


def test_crash_agent_needs_the_agent_form() -> None:
    with pytest.raises(StreamTestError, match=r"CrashAgent\(\): no agent serves the channel"):
        stream_test(agent_file_sink, [CrashAgent()])
    with pytest.raises(ConfigError, match="step 1"):
        stream_test(agent_file_sink, [object()])
