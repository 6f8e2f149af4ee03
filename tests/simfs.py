"""The simulated file system, re-exported for the test modules that ``from simfs import ...``.

It lives in :mod:`filechannel.testing.simfs` so that users get it too.
"""

from filechannel.testing.simfs import CRASH_MODES, CRASH_VARIANTS, MUTATING_OPS, ConcurrentSimFS, SimFS, Stats

__all__ = ["CRASH_MODES", "CRASH_VARIANTS", "MUTATING_OPS", "ConcurrentSimFS", "SimFS", "Stats"]
