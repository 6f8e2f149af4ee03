"""``serve --cache-bytes SIZE``: the take cache's bound of the channels a writable agent owns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli

import filechannel
from filechannel.errors import ChannelError

pytest.importorskip("pyarrow.flight")


def _serve_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str
) -> tuple[int, str, dict[str, Any]]:
    """Run ``serve DIR FLAGS``, the agent a stand-in; return the exit code, stderr and the agent's channel options."""
    import filechannel.agent.server as server

    d = str(tmp_path / "c")
    filechannel.open(d, minimum_required_space=0).close()
    seen: dict[str, Any] = {}

    def fake_serve(directories: Any, listen: str, **kw: Any) -> Any:
        seen.update(kw["channel_options"])
        raise ChannelError("stand-in agent: not started")

    monkeypatch.setattr(server, "serve", fake_serve)
    code, _, err = run_cli(capsys, "serve", d, "--listen", "grpc://127.0.0.1:0", *flags)
    return code, err, seen


def test_serve_passes_cache_bytes_to_the_channels_it_owns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err, opts = _serve_options(monkeypatch, capsys, tmp_path, "--writable", "--cache-bytes", "64M")
    assert code == 2  # the stand-in refuses to start
    assert "stand-in agent" in err, err  # the options were accepted and reached the agent
    assert opts["cache_bytes"] == 64 << 20
    # And a channel opened with those options bounds its cache by them.
    with filechannel.open(str(tmp_path / "o"), **opts) as ch:
        assert ch.config.cache_bytes == 64 << 20


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--cache-bytes", "64M"), "--cache-bytes applies to the channels an agent owns: add --writable"),
        (("--writable", "--cache-bytes", "64X"), "'64X' is not a size"),
    ],
)
def test_serve_cache_bytes_problems_are_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    flags: tuple[str, ...],
    needle: str,
) -> None:
    code, err, opts = _serve_options(monkeypatch, capsys, tmp_path, *flags)
    assert code == 2
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1
    assert not opts
