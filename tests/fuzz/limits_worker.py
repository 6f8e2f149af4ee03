"""Run decoders over crafted inputs under a memory limit and a per-input time limit (see tests/test_fuzz_limits.py).

Run as ``python limits_worker.py MEMORY_BYTES [AS|DATA]`` with a JSON list of
cases on stdin; each case is ``{"name", "target", "path", "budget", ...}``. The
address space (``RLIMIT_AS``, the default) or the heap (``RLIMIT_DATA``: private
writable memory, not a read-only file mapping) is capped before anything is
imported, and each case
runs under a ``SIGALRM`` of its ``budget`` seconds. One JSON line per case goes
to stdout: the outcome (``"ok"`` or the exception's class name), whether that
exception is one the target may raise, and the seconds it took.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Timeout(BaseException):
    """The case ran past its budget (a BaseException: no ``except Exception`` in the code under test hides it)."""


def _alarm(signum: int, frame: Any) -> None:
    raise Timeout()


def _targets() -> dict[str, tuple[Callable[[dict[str, Any]], None], tuple[type[BaseException], ...]]]:
    import filechannel
    from filechannel import checkpoint
    from filechannel import format as fmt
    from filechannel._fs import DEFAULT_FS
    from filechannel.config import ChannelConfig
    from filechannel.consumers import ConsumerStore
    from filechannel.errors import CorruptLogError, FormatError
    from filechannel.scan import CorruptionReport, Scanner
    from filechannel.verify import verify_channel
    from filechannel.wal import dump_wal, verify_wal

    def encryption(case: dict[str, Any]) -> Any:
        if not case.get("key"):
            return None
        from filechannel.crypto import Encryption

        return Encryption(keys={"k1": bytes.fromhex(case["key"])}, active_key="k1")

    def verify(case: dict[str, Any]) -> None:
        verify_channel(case["path"], encryption=encryption(case))

    def reader(case: dict[str, Any]) -> None:
        with filechannel.ChannelReader(case["path"], encryption=encryption(case)) as r:
            start, end = r.available()
            r.read(start, end)

    class Ctx:
        def __init__(self, kind: int, cid: bytes, policy: str) -> None:
            self.channel_id, self.crc_kind, self.max_payload = cid, kind, 1 << 26
            self.config = ChannelConfig(on_corruption=policy)

        def report_corruption(self, report: CorruptionReport) -> None:
            pass

        def note_torn_tail(self, path: str, start: int, size: int, reason: str) -> None:
            pass

    def scan(case: dict[str, Any]) -> None:
        # The one parser, directly: every data file of the case's directory, as the newest and as sealed.
        data = os.path.join(case["path"], "data")
        for name in sorted(n for n in os.listdir(data) if n.endswith(".wal")):
            path = os.path.join(data, name)
            with open(path, "rb") as f:
                buf = f.read()
            try:
                h = fmt.decode_file_header(buf)
            except FormatError:
                continue  # a header the decoder refuses: recovery's business (the other targets), not the scanner's
            if not isinstance(h, fmt.FileHeader):
                continue
            for policy in ("fail", "skip"):
                for newest in (True, False):
                    try:
                        Scanner(Ctx(h.crc_kind, h.channel_id, policy), path, h.file_id, buf, h).scan(newest, 0)
                    except CorruptLogError:
                        pass

    def checkpoint_decode(case: dict[str, Any]) -> None:
        with open(case["path"], "rb") as f:
            buf = f.read()
        checkpoint.decode(buf, case["crc_kind"], bytes.fromhex(case["channel_id"]))

    def acks(case: dict[str, Any]) -> None:
        ConsumerStore(DEFAULT_FS, case["path"]).list()

    def wal_verify(case: dict[str, Any]) -> None:
        verify_wal(case["path"])
        for _ in dump_wal(case["path"]):
            pass

    def wal_open(case: dict[str, Any]) -> None:
        # Opening writes (a torn tail is cut): a copy, made before the clock starts (see run()).
        with filechannel.WriteAheadLog(case["copy"], on_corruption=case.get("policy", "fail")) as w:
            for _ in w.read_all():
                pass

    def channel_open(case: dict[str, Any]) -> None:
        # The owner's open (recovery, ANCHOR, checkpoints): a copy, made before the clock starts (see main()).
        opts = {"encryption": encryption(case), "on_corruption": case.get("policy", "fail"), "background": False}
        with filechannel.open(case["copy"], minimum_required_space=0, **opts) as ch:
            ch.stats()

    corrupt = (CorruptLogError,)
    return {
        "verify": (verify, corrupt),
        "reader": (reader, corrupt),
        "scan": (scan, corrupt),
        # The decoder's own contract: FormatError (recovery turns it into a fallback or a CorruptLogError).
        "checkpoint_decode": (checkpoint_decode, (FormatError,)),
        "acks": (acks, corrupt),
        "wal_verify": (wal_verify, corrupt),
        "wal_open": (wal_open, corrupt),
        "open": (channel_open, corrupt),
    }


def main() -> None:
    limit = int(sys.argv[1])
    which = resource.RLIMIT_DATA if sys.argv[2:] == ["DATA"] else resource.RLIMIT_AS
    resource.setrlimit(which, (limit, limit))
    cases = json.load(sys.stdin)
    targets = _targets()
    signal.signal(signal.SIGALRM, _alarm)
    for case in cases:
        fn, allowed = targets[case["target"]]
        if case["target"] in ("wal_open", "open"):
            case["copy"] = case["path"] + ".copy"
            shutil.rmtree(case["copy"], ignore_errors=True)
            shutil.copytree(case["path"], case["copy"])
        outcome, ok, detail = "ok", True, ""
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, case["budget"])
        try:
            fn(case)
        except Timeout:
            outcome, ok = "timeout", False
        except BaseException as exc:
            outcome, ok = type(exc).__name__, isinstance(exc, allowed)
            if not ok:
                detail = "".join(traceback.format_exception(exc)[-3:])[-600:]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        secs = time.perf_counter() - t0
        out = {"name": case["name"], "outcome": outcome, "ok": ok, "seconds": secs, "detail": detail}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
