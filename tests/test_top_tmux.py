"""``filechannel top`` in a real terminal: started in tmux, its screen read, ``q`` and Ctrl-C pressed.

tmux (installed by ``scripts/clients.sh``) gives ``top`` a real pseudo-terminal,
so curses draws for real; ``capture-pane`` reads the screen. After ``top`` exits,
the same shell prints the exit status and the terminal's line discipline
(``stty -a``): a terminal left in curses' raw mode would show ``-icanon -echo``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import run_module

import filechannel

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (scripts/clients.sh installs it)")


class Terminal:
    """One tmux server of its own (``-L``), one 120x30 window running one shell command."""

    def __init__(self, name: str) -> None:
        self.name = name

    def tmux(self, *args: str) -> str:
        assert TMUX is not None
        r = subprocess.run([TMUX, "-L", self.name, *args], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def start(self, command: str) -> None:
        self.tmux("new-session", "-d", "-s", "t", "-x", "120", "-y", "30", command)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, what: str, ok: Callable[[str], bool], timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if ok(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed {what}:\n{text}")
            time.sleep(0.1)


@pytest.fixture
def term() -> Iterator[Terminal]:
    t = Terminal(f"fctop{os.getpid()}")
    try:
        yield t
    finally:
        subprocess.run([str(TMUX), "-L", t.name, "kill-server"], capture_output=True, timeout=10)


def _top_then_report(*argv: str) -> str:
    """A shell command: run ``top``, then print its exit status and the terminal's modes, then wait."""
    top = shlex.join([sys.executable, "-m", "filechannel", "top", *argv])
    modes = "stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '"
    # `trap : INT`: the shell survives Ctrl-C (a handled signal is reset to the default in top, not ignored)
    script = f"trap : INT; {top}; s=$?; echo; echo exit=$s; echo modes: $({modes}); sleep 600"
    return f"sh -c {shlex.quote(script)}"


def _depth(screen: str, channel: str) -> int | None:
    for line in screen.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == channel and parts[1].isdigit():
            return int(parts[1])
    return None


def _restored(term: Terminal, status: int) -> None:
    text = term.wait_for("the report after top", lambda s: "modes:" in s)
    assert f"exit={status}" in text
    assert "modes: icanon echo" in text  # cooked mode and echo are back
    assert "filechannel top  every" not in text  # the curses screen is gone
    assert term.tmux("display", "-p", "-t", "t", "#{alternate_on}").strip() == "0"


def _channel(d: Path, n: int) -> str:
    with filechannel.open(str(d), minimum_required_space=0) as ch, ch.transaction() as tx:
        for i in range(n):
            tx.put(b"event-%d" % i)
    return str(d)


def test_top_shows_the_depth_follows_puts_and_quits_on_q(tmp_path: Path, term: Terminal) -> None:
    d = _channel(tmp_path / "orders", 7)
    term.start(_top_then_report(d, "--interval", "0.3"))
    screen = term.wait_for("depth 7", lambda s: _depth(s, "orders") == 7)
    assert "filechannel top  every 0.3s" in screen
    assert "PUT/s" in screen
    assert f"{d} (dir)" in screen
    r = run_module("put", d, stdin=b"".join(b"more-%d\n" % i for i in range(25)))
    assert r.returncode == 0, r.stderr
    term.wait_for("depth 32", lambda s: _depth(s, "orders") == 32)
    term.keys("q")
    _restored(term, 0)


def _top_pid(term: Terminal) -> int:
    shell = int(term.tmux("display", "-p", "-t", "t", "#{pane_pid}"))
    with open(f"/proc/{shell}/task/{shell}/children") as f:
        (child,) = f.read().split()
    return int(child)


@pytest.mark.parametrize(("stop", "status"), [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_ctrl_c_and_sigterm_restore_the_terminal(tmp_path: Path, term: Terminal, stop: str, status: int) -> None:
    d = _channel(tmp_path / "orders", 3)
    term.start(_top_then_report(d))
    term.wait_for("depth 3", lambda s: _depth(s, "orders") == 3)
    if stop == "Ctrl-C":
        term.keys("C-c")
    else:
        os.kill(_top_pid(term), signal.SIGTERM)
    _restored(term, status)


def test_top_of_an_agent_shows_its_channel(tmp_path: Path, term: Terminal) -> None:
    pytest.importorskip("pyarrow.flight")
    from filechannel.agent import connect, serve

    d = _channel(tmp_path / "payments", 4)
    with serve([d], "grpc://127.0.0.1:0", writable=True, channel_options={"minimum_required_space": 0}) as a:
        term.start(_top_then_report(a.location, "--interval", "0.3"))
        term.wait_for("the agent's channel, depth 4", lambda s: _depth(s, "payments") == 4)
        with connect(a.location) as c:
            (cid,) = c.channels()
            c.put_batch(cid, [b"p"] * 6, producer="t", sequence=1)
        screen = term.wait_for("depth 10", lambda s: _depth(s, "payments") == 10)
        assert f"{a.location} (agent)" in screen
        term.keys("q")
        _restored(term, 0)
