"""A Flume FileChannel's configuration, brought over: the mapping, its refusals, the CLI flag."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from helpers import run_module

import filechannel
from filechannel.errors import ConfigError
from filechannel.flume import options_from_properties, parse_properties

AGENT = """
# a Flume agent
a1.sources = r1
a1.channels = c1
a1.sources.r1.type = netcat
a1.channels.c1.type = file
a1.channels.c1.checkpointDir = /var/flume/checkpoint
a1.channels.c1.dataDirs = /mnt/d1/flume , /mnt/d2/flume
a1.channels.c1.capacity = 2000000
a1.channels.c1.transactionCapacity: 5000
a1.channels.c1.checkpointInterval = 60000
a1.channels.c1.maxFileSize = 1073741824
a1.channels.c1.minimumRequiredSpace = 1048576
a1.channels.c1.keep-alive = 5
a1.channels.c1.useDualCheckpoints = true
a1.channels.c1.backupCheckpointDir = /mnt/d2/flume-ckpt-backup
a1.channels.c1.use-fast-replay = \\
    false
"""


def test_the_mapping(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="filechannel.flume"):
        got = options_from_properties(parse_properties(AGENT))
    assert got.channel == "a1.channels.c1"
    assert got.options == {
        "data_dirs": ("/mnt/d1/flume", "/mnt/d2/flume"),
        "capacity": 2_000_000,
        "transaction_capacity": 5000,
        "checkpoint_interval": 60.0,  # milliseconds in Flume
        "max_file_size": 1 << 30,
        "minimum_required_space": 1 << 20,
        "keep_alive": 5.0,
        "backup_checkpoint_dir": "/mnt/d2/flume-ckpt-backup",
    }
    assert dict(got.ignored).keys() == {"checkpointDir", "use-fast-replay"}
    assert "checkpointDir" in caplog.text  # each key left out is named


def test_fsync_per_transaction_false_is_interval_and_skip() -> None:
    props = {
        "a.channels.c.type": "file",
        "a.channels.c.fsyncPerTransaction": "false",
        "a.channels.c.fsyncInterval": "2",
    }
    assert options_from_properties(props).options == {
        "fsync": "interval",
        "on_corruption": "skip",
        "fsync_interval": 2.0,
    }


@pytest.mark.parametrize(
    ("props", "channel", "msg"),
    [
        ({"a.channels.c.type": "memory"}, None, "0 file channels"),
        ({"a.channels.c.type": "file", "a.channels.d.type": "file"}, None, "2 file channels"),
        ({"a.channels.c.type": "file"}, "x", "no single file channel 'x'"),
        ({"a.channels.c.type": "file", "a.channels.c.capacity": "lots"}, None, "capacity = 'lots'"),
        ({"a.channels.c.type": "file", "a.channels.c.encryption.activeKey": "k"}, None, "filechannel keygen"),
        ({"a.channels.c.type": "file", "a.channels.c.useDualCheckpoints": "true"}, None, "needs backupCheckpointDir"),
    ],
)
def test_refusals(props: dict[str, str], channel: str | None, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        options_from_properties(props, channel)


def test_a_channel_named_among_several() -> None:
    props = {"a.channels.c.type": "file", "a.channels.c.capacity": "7", "a.channels.d.type": "file"}
    assert options_from_properties(props, "c").options == {"capacity": 7}
    assert options_from_properties(props, "a.channels.c").options == {"capacity": 7}


def test_the_cli_flag_and_open(tmp_path: Path) -> None:
    conf = tmp_path / "flume.conf"
    conf.write_text("a.channels.c.type = file\na.channels.c.transactionCapacity = 3\na.channels.c.capacity = 100\n")
    d = str(tmp_path / "ch")
    r = run_module("put", d, "--flume-properties", str(conf), "--batch", "4", stdin=b"1\n2\n3\n4\n")
    assert r.returncode == 2  # a batch of 4 is more than Flume's transactionCapacity = 3
    assert "transaction" in r.stderr
    r = run_module(
        "put", d, "--flume-properties", str(conf), "--transaction-capacity", "10", "--batch", "4", stdin=b"1\n2\n3\n4\n"
    )
    assert r.returncode == 0, r.stderr  # the flag wins over the file
    opts = options_from_properties(conf).options
    with filechannel.open(d, minimum_required_space=0, **opts) as ch:
        assert ch.config.capacity == 100
        assert ch.size == 4
    r = run_module("put", d, "--flume-properties", str(tmp_path / "missing.conf"), stdin=b"")
    assert r.returncode == 2
    assert "cannot read" in r.stderr
