"""The command line every atheris target here shares: fuzz with atheris, or replay input files without it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence


def run(test_one_input: Callable[[bytes], None], instrument: Sequence[str]) -> None:
    """Fuzz ``test_one_input`` with coverage of the ``instrument`` modules; without atheris, replay ``argv``'s files."""
    try:
        import atheris
    except ImportError:  # replay the given files without coverage guidance
        for p in sys.argv[1:]:
            with open(p, "rb") as f:
                test_one_input(f.read())
        return
    with atheris.instrument_imports():
        for name in instrument:  # imported here first, so that atheris instruments them
            importlib.import_module(name)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
