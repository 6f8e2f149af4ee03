"""Options are typed: a user's type checker rejects a wrong option before anything runs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import filechannel
from filechannel.config import ChannelConfig, ChannelOptions


def test_the_typed_options_are_the_config_fields() -> None:
    assert set(ChannelOptions.__annotations__) == {f.name for f in dataclasses.fields(ChannelConfig)}


GOOD = """
import filechannel
ch = filechannel.open("/tmp/x", capacity=10, fsync="interval", data_dirs=["/a", "/b"], encryption=None)
n: int = len(ch)
"""

BAD = """
import filechannel
filechannel.open("/tmp/x", capacity="10")
filechannel.open("/tmp/x", fsync="sometimes")
filechannel.open("/tmp/x", capacty=10)
"""


def _mypy(tmp_path: Path, name: str, code: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy")
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / "cache"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
        env={**os.environ, "MYPYPATH": str(Path(filechannel.__file__).parent.parent)},
    )


def _errors(out: subprocess.CompletedProcess[str], name: str) -> list[str]:
    """The errors mypy reports in the user's script (the library is checked by the lint step, with its own config)."""
    return [x for x in out.stdout.splitlines() if x.startswith(f"{name}.py:") and ": error:" in x]


def test_a_type_checker_rejects_wrong_options(tmp_path: Path) -> None:
    good = _mypy(tmp_path, "good", GOOD)
    assert _errors(good, "good") == [], good.stdout
    bad = _mypy(tmp_path, "bad", BAD)
    errors = _errors(bad, "bad")
    assert [int(x.split(":")[1]) for x in errors] == [3, 4, 5], bad.stdout  # each wrong call, and only those
    assert '"capacity"' in errors[0]
    assert '"capacty"' in errors[2]
