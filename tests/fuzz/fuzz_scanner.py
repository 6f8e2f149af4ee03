"""atheris target: recovery of a data file holding arbitrary bytes (see README.md)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_BASE: list[object] = []


def _base() -> tuple[object, str, bytes]:
    if not _BASE:
        from simfs import SimFS

        import filechannel

        fs = SimFS()
        ch = filechannel.open("/sim/ch", fs=fs, background=False, minimum_required_space=0, max_file_size=4096)
        for i in range(3):
            with ch.transaction() as tx:
                tx.put(b"event %d" % i)
        ch.close()
        path = "/sim/ch/data/seg-0000000000000001.wal"
        _BASE.extend((fs, path, fs.read(path)))
    return _BASE[0], _BASE[1], _BASE[2]  # type: ignore[return-value]


def test_one_input(data: bytes) -> None:
    import filechannel

    fs0, path, orig = _base()
    fs = fs0.snapshot()  # type: ignore[attr-defined]
    # the first two bytes choose where the fuzzer's bytes go
    at = int.from_bytes(data[:2], "little") % (len(orig) + 1) if len(data) >= 2 else 0
    fs.write(path, orig[:at] + data[2:])
    for mode in ("fail", "skip"):
        try:
            ch = filechannel.open(
                "/sim/ch", fs=fs, background=False, minimum_required_space=0, replay="full", on_corruption=mode
            )
        except filechannel.CorruptLogError:
            continue
        try:
            with ch.transaction() as tx:
                for e in tx.take_batch(1000):
                    if e.body != b"event %d" % e.position:
                        raise AssertionError(f"altered event at {e.position}: {e.body!r}")
        except filechannel.CorruptLogError:
            pass
        finally:
            ch.close()


def main() -> None:
    from _cli import run

    run(test_one_input, ["filechannel.format", "filechannel.log"])


if __name__ == "__main__":
    main()
