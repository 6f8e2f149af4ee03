"""Which per-event path runs: the optional C accelerator or the pure-Python twin.

This module owns one decision, made once at import: load
``filechannel._speedups`` (built by setup.py where a compiler exists) unless
``FILECHANNEL_PURE_PYTHON=1`` forces the pure-Python path, and give it
google-crc32c's own CRC-32C (the ``libcrc32c`` its wheel ships) when that
library can be found. ``format.py`` keeps the result as ``format.speedups``;
the Python code in ``format.py`` and ``scan.py`` is the reference
implementation that ``tests/test_speedups.py`` holds the C code to.

It also owns :func:`trim_heap` (glibc's ``malloc_trim``, through the
accelerator or else ``ctypes``), which replay calls once when it ends.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
from typing import Any, Final

logger = logging.getLogger(__name__)

PURE_PYTHON_ENV: Final = "FILECHANNEL_PURE_PYTHON"


def load() -> Any:
    """Return the ``_speedups`` module, or None on the pure-Python path."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    try:
        mod = importlib.import_module("filechannel._speedups")
    except ImportError as exc:  # no compiler at install time: the pure path, said once
        logger.debug("filechannel: C accelerator unavailable (%s); using the pure-Python path", exc)
        return None
    try:
        import google_crc32c
    except ImportError:  # pragma: no cover - google-crc32c is a dependency
        return mod
    # The wheel ships libcrc32c next to the package; ``import google_crc32c`` loaded it already.
    libs = os.path.dirname(os.path.abspath(google_crc32c.__file__)) + ".libs"
    for lib in sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*"))):
        if mod.bind_crc32c(lib):
            break
    return mod


def trim_heap(speedups: Any) -> bool:
    """Hand free heap pages back to the system (glibc's ``malloc_trim(0)``); False where there is none.

    After a full replay, what recovery freed lies below the queue's columns
    (they grew last), and glibc returns only the top of the heap on its own.
    """
    if speedups is not None:
        return bool(speedups.trim_heap())
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim  # the pure-Python path: the same call, through ctypes
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(trim(0))
