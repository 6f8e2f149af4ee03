"""atheris target: the format decoders raise nothing but FormatError (see README.md)."""

from __future__ import annotations

import sys


def test_one_input(data: bytes) -> None:
    from filechannel import format as fmt
    from filechannel.errors import FormatError

    kind = fmt.default_crc_kind()
    seed = fmt.file_seed(kind, b"\x01" * 16, 1)
    for fn in (
        lambda b: fmt.decode_record(b, 0, seed, kind, 1 << 20),
        fmt.decode_file_header,
        fmt.decode_event,
        fmt.decode_take,
        fmt.decode_commit,
        fmt.decode_batch_end,
        fmt.decode_rollback,
        fmt.decode_retire,
    ):
        try:
            fn(data)
        except FormatError:
            pass


def main() -> None:
    try:
        import atheris
    except ImportError:  # replay the given files without coverage guidance
        for p in sys.argv[1:]:
            with open(p, "rb") as f:
                test_one_input(f.read())
        return
    with atheris.instrument_imports():
        import filechannel.format  # noqa: F401
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
