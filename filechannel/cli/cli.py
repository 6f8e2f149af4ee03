"""The command line's terminal: the one module of filechannel that prints.

Every line the ``filechannel`` commands show (results on stdout, one-line
errors and progress on stderr) goes through :func:`echo`; the library logs
instead (``logging``), and the command line decides what of that to show.
"""

from __future__ import annotations

from typing import IO


def echo(*values: object, file: IO[str] | None = None) -> None:
    """Print ``values`` (to stdout, or to ``file``): ``print``, for the command line only."""
    print(*values, file=file)
