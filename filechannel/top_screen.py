"""The loop and the drawing of ``filechannel top``: a curses screen on a terminal, plain lines elsewhere.

This module owns the timing (a refresh every ``interval`` seconds) and the
output: on a terminal a full-screen view drawn with the standard library's
``curses`` (``q`` quits; Ctrl-C too, and ``curses.wrapper`` gives the terminal
back either way); when stdout is not a terminal, the same table as plain lines
at each refresh; with ``once``, one table (or one JSON document) from two
samples ``interval`` apart. What is shown is computed in ``top.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from .top import Sample, document, rows, table
from .top_sources import Source

__all__ = ["run"]

QUIT_KEYS = (ord("q"), ord("Q"))


def _sample_all(sources: Sequence[Source]) -> list[Sample]:
    return [s.sample() for s in sources]


def _lines(before: Sequence[Sample | None], after: Sequence[Sample]) -> list[str]:
    all_rows: list[dict[str, Any]] = []
    for b, a in zip(before, after, strict=True):
        all_rows.extend(rows(b, a))
    return table(all_rows)


def run(
    sources: Sequence[Source],
    interval: float,
    out: IO[str],
    *,
    once: bool = False,
    as_json: bool = False,
    screen: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Show ``sources`` until ``q`` (screen) or Ctrl-C; with ``once``, one view and return. Returns 0."""
    if once:
        first = _sample_all(sources)
        sleep(interval)
        second = _sample_all(sources)
        if as_json:
            out.write(json.dumps(document(first, second, time.time())) + "\n")
        else:
            out.write("\n".join(_lines(first, second)) + "\n")
        out.flush()
        return 0
    if screen:
        import curses  # only on a terminal

        result: int = curses.wrapper(_screen, sources, interval)
        return result
    prev: list[Sample | None] = [None] * len(sources)
    while True:
        cur = _sample_all(sources)
        out.write(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n" + "\n".join(_lines(prev, cur)) + "\n\n")
        out.flush()
        prev = list(cur)
        sleep(interval)


def _screen(stdscr: Any, sources: Sequence[Source], interval: float) -> int:
    """The curses loop: sample, draw, wait for ``interval`` while reading keys; ``q`` returns 0."""
    import curses

    try:
        curses.curs_set(0)
    except curses.error:
        pass  # a terminal that cannot hide the cursor
    prev: list[Sample | None] = [None] * len(sources)
    cur = _sample_all(sources)
    while True:
        _draw(stdscr, interval, _lines(prev, cur))
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0:
            stdscr.timeout(max(1, int(left * 1000)))
            key = stdscr.getch()
            if key in QUIT_KEYS:
                return 0
            if key == curses.KEY_RESIZE:
                _draw(stdscr, interval, _lines(prev, cur))
        prev, cur = list(cur), _sample_all(sources)


def _draw(stdscr: Any, interval: float, lines: list[str]) -> None:
    import curses

    height, width = stdscr.getmaxyx()
    stdscr.erase()
    title = f"filechannel top  every {interval:g}s  {time.strftime('%H:%M:%S')}  (q quits)"
    for y, text in enumerate([title, *lines][: max(0, height - 1)]):
        try:
            stdscr.addnstr(y, 0, text, max(0, width - 1), curses.A_BOLD if y <= 1 else curses.A_NORMAL)
        except curses.error:
            pass  # the last cell of a tiny window
    stdscr.refresh()
