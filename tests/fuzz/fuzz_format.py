"""atheris target: the format decoders raise nothing but FormatError (see README.md)."""

from __future__ import annotations


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
    from _cli import run

    run(test_one_input, ["filechannel.format"])


if __name__ == "__main__":
    main()
