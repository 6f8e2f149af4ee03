"""Option validation: every bad value raises ConfigError naming the option, before touching the disk."""

from __future__ import annotations

import os
from typing import Any

import pytest

import filechannel
from filechannel.config import ChannelConfig

BAD: list[tuple[str, Any]] = [
    ("capacity", 0),
    ("capacity", -1),
    ("capacity", 1.5),
    ("capacity", "10"),
    ("capacity", True),
    ("transaction_capacity", 0),
    ("transaction_capacity", None),
    ("max_file_size", 100),
    ("max_file_size", 0),
    ("max_file_size", 2**41),
    ("max_file_size", 4096.0),
    ("max_event_size", 0),
    ("max_event_size", -5),
    ("max_event_size", 1.5),
    ("max_event_size", 1 << 40),
    ("max_event_size", "big"),
    ("fsync", "always"),
    ("fsync", None),
    ("fsync_interval", 0),
    ("fsync_interval", -1.0),
    ("fsync_interval", float("nan")),
    ("fsync_interval", float("inf")),
    ("fsync_interval", "5"),
    ("keep_alive", -0.1),
    ("keep_alive", float("nan")),
    ("keep_alive", False),
    ("minimum_required_space", -1),
    ("minimum_required_space", 1.0),
    ("on_corruption", "ignore"),
    ("on_corruption", None),
    ("data_dirs", "/tmp/a"),
    ("data_dirs", []),
    ("data_dirs", ["/tmp/a", "/tmp/a"]),
    ("data_dirs", ["/tmp/a", 3]),
    ("data_dirs", [""]),
    ("data_dirs", 5),
    ("cache_bytes", -1),
    ("cache_bytes", "16M"),
]


@pytest.mark.parametrize(("option", "value"), BAD, ids=[f"{o}={v!r}" for o, v in BAD])
def test_bad_value_raises_config_error_naming_the_option(option: str, value: Any, tmp_path: Any) -> None:
    d = tmp_path / "ch"
    with pytest.raises(filechannel.ConfigError) as ei:
        filechannel.open(d, **{option: value})
    err = ei.value
    assert isinstance(err, ValueError)
    assert isinstance(err, filechannel.ChannelError)
    assert err.option == option
    assert option in str(err)
    assert not d.exists(), "a bad option must be refused before anything touches the disk"


def test_cross_option_rules() -> None:
    with pytest.raises(filechannel.ConfigError, match="transaction_capacity"):
        ChannelConfig(capacity=10, transaction_capacity=11)
    with pytest.raises(filechannel.ConfigError, match="max_event_size"):
        ChannelConfig(max_file_size=8192, max_event_size=8192)
    ChannelConfig(capacity=10, transaction_capacity=10)
    ChannelConfig(max_file_size=8192, max_event_size=8192 - 1024)


def test_unknown_option(tmp_path: Any) -> None:
    with pytest.raises(filechannel.ConfigError) as ei:
        filechannel.open(tmp_path / "ch", capacty=10)
    assert ei.value.option == "capacty"
    assert "unknown option" in str(ei.value)
    assert "capacity" in str(ei.value)  # the known names are listed
    assert not (tmp_path / "ch").exists()


def test_defaults() -> None:
    c = ChannelConfig()
    assert c.capacity == 1_000_000
    assert c.transaction_capacity == 10_000
    assert c.max_file_size == 64 * 1024 * 1024
    assert c.max_event_size == 8 * 1024 * 1024
    assert c.fsync == "commit"
    assert c.fsync_interval == 5.0
    assert c.keep_alive == 3.0
    assert c.minimum_required_space == 64 * 1024 * 1024
    assert c.on_corruption == "fail"
    assert c.data_dirs is None
    assert c.cache_bytes == 16 * 1024 * 1024


def test_max_event_size_default_shrinks_with_small_files() -> None:
    assert ChannelConfig(max_file_size=8192).max_event_size == 8192 - 1024


def test_max_event_size_none_is_the_default_and_resolves_to_an_int() -> None:
    assert ChannelConfig(max_event_size=None).max_event_size == 8 * 1024 * 1024
    assert ChannelConfig.from_options({"max_event_size": None}).max_event_size == 8 * 1024 * 1024
    assert ChannelConfig(max_file_size=8192, max_event_size=None).max_event_size == 8192 - 1024
    assert ChannelConfig(max_event_size=1).max_event_size == 1


@pytest.mark.parametrize("value", [0, -1])
def test_max_event_size_zero_or_negative_is_refused_with_the_fix(value: int) -> None:
    # 0 used to be accepted silently (as "the default"); now it is an error that says what to do.
    with pytest.raises(filechannel.ConfigError) as ei:
        ChannelConfig(max_event_size=value)
    assert ei.value.option == "max_event_size"
    assert f"got {value}" in str(ei.value)
    assert "leave it out for the default" in str(ei.value)


def test_config_is_frozen_and_data_dirs_normalized() -> None:
    c = ChannelConfig.from_options({"data_dirs": ["/a", "/b"]})
    assert c.data_dirs == ("/a", "/b")
    from pathlib import Path

    assert ChannelConfig.from_options({"data_dirs": [Path("/a"), "/b"]}).data_dirs == ("/a", "/b")
    with pytest.raises(AttributeError):
        c.capacity = 5  # type: ignore[misc]


def test_open_passes_options_through(tmp_path: Any) -> None:
    with filechannel.open(os.fspath(tmp_path / "ch"), capacity=7, transaction_capacity=3, keep_alive=0) as ch:
        assert ch.config.capacity == 7
        assert ch.config.transaction_capacity == 3
        assert ch.config.keep_alive == 0
