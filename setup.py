"""Build filechannel's optional C accelerator, ``filechannel._speedups``.

Everything else about the package lives in setup.cfg. The extension is
optional: without a compiler (or zlib's headers) the build logs why and goes
on, and filechannel runs its pure-Python path (``stats()["accelerator"]``
says which one is active).
"""

from __future__ import annotations

import logging

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

logger = logging.getLogger("filechannel.setup")


class OptionalBuildExt(build_ext):
    """A build_ext that logs a failed compile and continues without the extension."""

    def run(self) -> None:
        """Build the extensions; a failure is logged and the install goes on."""
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means: no accelerator
            logger.warning("filechannel: not building the C accelerator (%s); the pure-Python path will run", exc)

    def build_extension(self, ext: Extension) -> None:
        """Build one extension; a failure is logged and the install goes on."""
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            logger.warning("filechannel: could not build %s (%s); the pure-Python path will run", ext.name, exc)


setup(
    ext_modules=[
        Extension(
            "filechannel._speedups",
            sources=["filechannel/_speedups.c"],
            libraries=["z"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
