"""Docs execute: every CLI command has help and is in docs/cli.md; the README examples run."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from filechannel import cli

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _helps() -> dict[str, str]:
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    raise AssertionError("no subcommands")


COMMANDS = sorted(_subparsers())


def test_the_commands_of_the_issue_exist() -> None:
    assert {"put", "take", "stat", "dump", "verify"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_has_help_and_is_documented(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _helps()[command].strip(), f"{command} has no help line"
    with pytest.raises(SystemExit) as ei:
        cli.main([command, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: filechannel {command}" in out
    assert f"## `{command}`" in CLI_MD, f"docs/cli.md has no section for {command}"
    section = CLI_MD.split(f"## `{command}`", 1)[1].split("\n## ", 1)[0]
    nested = [a for a in _subparsers()[command]._actions if isinstance(a, argparse._SubParsersAction)]
    # A command with subcommands (``wal dump``, ``wal verify``): each has help, options and a usage line.
    parsers = {f"{command} {name}": p for a in nested for name, p in a.choices.items()} or {
        command: _subparsers()[command]
    }
    first = "KEYSTORE" if command == "keygen" else "DIR"  # keygen makes a key file, not a channel
    for name, sub in parsers.items():
        for action in sub._actions:
            for opt in action.option_strings:
                if opt in ("-h", "--help"):
                    continue
                assert opt in section, f"docs/cli.md does not document {name} {opt}"
        assert f"filechannel {name} {first}" in section, f"docs/cli.md shows no usage line for {name}"
        if name != command:
            with pytest.raises(SystemExit) as ei:
                cli.main([*name.split(), "--help"])
            assert ei.value.code == 0
            assert f"usage: filechannel {name}" in capsys.readouterr().out


def test_exit_codes_are_documented() -> None:
    for code in ("| 0 |", "| 1 |", "| 2 |"):
        assert code in CLI_MD


def run_readme_block(heading: str, tmp_path: Path) -> list[str]:
    """Run the first python block of a README section on a channel in ``tmp_path``; return its output lines."""
    section = README.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert m, f"README section {heading!r} has no python block"
    code = m.group(1)
    assert "/var/lib/myapp/channel" in code
    code = code.replace("/var/lib/myapp/channel", str(tmp_path / "channel"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return out.getvalue().splitlines()


def test_readme_quick_start_runs(tmp_path: Path) -> None:
    lines = run_readme_block("Quick start", tmp_path)
    assert lines[0] == "b'payload' {'source': 'web-1'} 0"
    size, fsyncs = lines[1].split()
    assert int(size) == 4  # e1, e2, e3 and "x" are queued
    assert int(fsyncs) >= 3


def test_docs_exist_and_are_linked() -> None:
    for name in ("cli.md", "format.md", "design.md"):
        assert (ROOT / "docs" / name).is_file()
        assert f"docs/{name}" in README


def test_readme_reader_example_runs(tmp_path: Path) -> None:
    assert run_readme_block("Reading from another process", tmp_path) == [
        "0 b'a'",
        "1 b'b'",
        "2 b'c'",
        "0",
        "3 5 [b'd', b'e']",
        "gone 0 3",
    ]


def test_readme_encryption_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("cryptography", reason="the crypto extra is not installed")
    assert run_readme_block("Encryption at rest", tmp_path) == [
        "['2026-10', '2026-11']",
        "[b'card 4111', b'card 5500']",
        "refused 2026-11",
    ]
    for root, _dirs, files in os.walk(tmp_path / "channel"):
        for f in files:
            data = (Path(root) / f).read_bytes()
            assert b"card 4" not in data
            assert b"alice" not in data


def _install_lines() -> list[tuple[str, str]]:
    """Every ``pip install`` the README and docs/*.md show: (file, the line)."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in doc.read_text(encoding="utf-8").splitlines():
            if "pip install" in line:
                out.append((doc.name, line))
    return out


def test_the_readme_says_how_to_install_from_the_checkout() -> None:
    import configparser
    import sys

    section = README.split("## Installing", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Installing section has no bash block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    assert ".venv/bin/pip install ." in commands  # without extras
    assert ".venv/bin/pip install -e '.[crypto]'" in commands  # editable, with one
    assert ".venv/bin/filechannel --help" in commands  # where the CLI is
    # Every extra a doc installs exists, and nothing is installed by name: the package is not on PyPI.
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    assert "filechannel = filechannel.cli:main" in cfg["options.entry_points"]["console_scripts"]
    for doc, line in _install_lines():
        assert not re.search(r"pip install '?filechannel\b", line), f"{doc}: installs from PyPI: {line}"
        for named in re.findall(r"\[([\w,]+)\]'", line):
            assert set(named.split(",")) <= extras, f"{doc}: no such extra in {line}"
    # The errors that say how to install an extra say it the same way.
    for src in sorted((ROOT / "filechannel").rglob("*.py")):
        text = src.read_text(encoding="utf-8")
        assert not re.search(r"pip install '?filechannel\b", text), f"{src.name} tells users to install from PyPI"
    # The CLI lands next to the interpreter of the venv (what the README points at).
    if sys.prefix != sys.base_prefix:
        assert (Path(sys.prefix) / "bin" / "filechannel").exists()


def test_cli_md_lists_every_op_dump_prints_and_says_nothing_twice() -> None:
    from filechannel.format import BATCH_END, OP_NAMES

    section = CLI_MD.split("## `dump`", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"`op` \(([^)]*)\)", section)
    assert listed, "docs/cli.md's dump section lists no ops"
    printed = {name for op, name in OP_NAMES.items() if op != BATCH_END}  # BATCH_END is verified, not printed
    assert set(re.findall(r"`(\w+)`", listed.group(1))) == printed
    assert " ".join(CLI_MD.split()).count("read-only and a put is refused") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_agents_md_first_agent_in_five_minutes_runs_as_written(tmp_path: Path) -> None:
    """Every block of the quick start, in order, in one shell (python blocks through the venv's python)."""
    import shutil
    import signal
    import subprocess
    import sys

    for tool in ("openssl", "curl"):
        assert shutil.which(tool), f"the quick start needs {tool}"
    doc = (ROOT / "docs" / "agents.md").read_text(encoding="utf-8")
    section = doc.split("## First agent in five minutes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(bash|python)\n(.*?)```", section, re.S)
    assert [kind for kind, _ in blocks] == ["bash", "bash", "bash", "python", "bash", "bash"]
    script = ["set -euo pipefail"]
    for kind, code in blocks:
        script.append(code if kind == "bash" else f"python - <<'PY'\n{code}PY\n")
    text = "\n".join(script)
    flight, http = _free_port(), _free_port()  # the doc's ports may be taken on a shared machine
    text = text.replace("8815", str(flight)).replace("8443", str(http))
    (tmp_path / "quickstart.sh").write_text(text)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.Popen(
        ["bash", "quickstart.sh"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert '{"channel": "orders", "duplicate": false, "events": 2}' in lines
    assert "orders 0 b'first event' {}" in lines
    assert "orders 1 b'hello' {'region': 'eu'}" in lines
    assert "orders 2 b'world' {}" in lines
    assert 'filechannel_channel_size{channel="orders"} 3.0' in lines
    assert "stopped serving" in err  # the agent stopped gracefully
    assert not (tmp_path / "agent.port").exists()  # removed on a graceful stop
    for secret in ("ca.key", "agent.key", "reader.key", "token"):
        assert (tmp_path / "pki" / secret).stat().st_mode & 0o077 == 0
