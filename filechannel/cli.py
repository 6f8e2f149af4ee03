"""The ``filechannel`` command: put, take, stat, dump, verify.

This is the only module that prints. Every ``ChannelError`` and ``OSError``
becomes one line on stderr and a non-zero exit status, never a traceback.
Exit status: 0 success, 1 verify found problems, 2 usage or channel error.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from . import format as fmt
from ._fs import DEFAULT_FS
from ._version import __version__
from .channel import CHECKPOINT_DIR, FileChannel, replay_queue
from .checkpoint import CheckpointStore
from .config import ChannelConfig
from .errors import ChannelError, NotAChannelError
from .log import CHANNEL_FILE, LOCK_FILE, Log

_EPILOG = "Exit status: 0 on success, 1 when verify finds problems, 2 on bad input or a channel error."


def _existing(path: str) -> str:
    if not os.path.isdir(path):
        raise ChannelError(f"{path}: no such channel directory")
    if not os.path.exists(os.path.join(path, CHANNEL_FILE)):
        raise NotAChannelError(path, "no CHANNEL file (create a channel with `filechannel put` or filechannel.open)")
    return path


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _body_text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(body).decode("ascii")


def _in_use(directory: str) -> bool:
    """Return whether another process holds the channel's lock."""
    path = os.path.join(directory, LOCK_FILE)
    if not os.path.exists(path):
        return False
    try:
        handle = DEFAULT_FS.lock(path)
    except BlockingIOError:
        return True
    DEFAULT_FS.unlock(handle)
    return False


def _progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr)


# -- commands ---------------------------------------------------------------------------


def cmd_put(args: argparse.Namespace) -> int:
    """Put one event per stdin line."""
    headers: dict[str, str] = {}
    for h in args.header or []:
        if "=" not in h:
            raise ChannelError(f"--header {h!r}: expected KEY=VALUE")
        k, v = h.split("=", 1)
        headers[k] = v
    n = 0
    with FileChannel(args.dir, ChannelConfig.from_options(_opts(args))) as ch:
        batch: list[bytes] = []
        stdin = sys.stdin.buffer
        for line in stdin:
            batch.append(line.rstrip(b"\n"))
            if len(batch) >= args.batch:
                n += _put_batch(ch, batch, headers)
                batch = []
        if batch:
            n += _put_batch(ch, batch, headers)
    print(f"put {n} events", file=sys.stderr)
    return 0


def _put_batch(ch: FileChannel, batch: list[bytes], headers: dict[str, str]) -> int:
    with ch.transaction() as tx:
        tx.put_many(batch, headers=headers or None)
    return len(batch)


def cmd_take(args: argparse.Namespace) -> int:
    """Print and remove events."""
    _existing(args.dir)
    with FileChannel(args.dir, ChannelConfig.from_options(_opts(args))) as ch:
        left = args.n
        out = sys.stdout
        while left > 0:
            with ch.transaction() as tx:
                evs = tx.take_batch(min(left, ch.config.transaction_capacity, 1000), timeout=args.wait)
                for ev in evs:
                    if args.json:
                        rec = {"position": ev.position, "headers": dict(ev.headers), "body": _body_text(ev.body)}
                        out.write(json.dumps(rec) + "\n")
                    else:
                        out.write(_body_text(ev.body) + "\n")
                out.flush()
            if not evs:
                break
            left -= len(evs)
    return 0


def _store(directory: str) -> CheckpointStore:
    return CheckpointStore(DEFAULT_FS, os.path.join(directory, CHECKPOINT_DIR))


def _readonly_channel_state(
    directory: str, skip: bool = False, use_checkpoint: bool = False
) -> tuple[Log, list[tuple[int, int, int, int]]]:
    cfg = ChannelConfig(on_corruption="skip" if skip else "fail")
    log = Log(
        directory,
        cfg,
        readonly=True,
        checkpoints=_store(directory) if use_checkpoint else None,
        progress=_progress if sys.stderr.isatty() else None,
    )
    try:
        q, _, _ = replay_queue(log, log.base_snapshot)
    except BaseException:
        log.close()
        raise
    return log, list(q)


def cmd_stat(args: argparse.Namespace) -> int:
    """Print the channel's state."""
    _existing(args.dir)
    _progress(f"reading {args.dir} ...")
    log, entries = _readonly_channel_state(args.dir, use_checkpoint=True)
    try:
        st = log.stats()
        files = []
        for fid in log.file_ids():
            path = log.file_path(fid)
            files.append({"file_id": fid, "path": path, "bytes": os.path.getsize(path)})
        info: dict[str, Any] = {
            "directory": args.dir,
            "in_use": _in_use(args.dir),
            "queue_size": len(entries),
            "head_position": entries[0][0] if entries else None,
            "tail_position": entries[-1][0] if entries else None,
            "next_position": log.next_position,
            "last_woid": log.last_woid,
            "files": files,
            "disk_bytes": st["disk_bytes"],
            "torn_tails": len(log.torn_tails),
            "checkpoint": _checkpoint_info(log),
            "last_open": _store(args.dir).last_open(),
        }
    finally:
        log.close()
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            if k == "files":
                print(f"files: {len(v)}")
                for f in v:
                    print(f"  {f['path']}  {f['bytes']} bytes")
            elif isinstance(v, dict):
                print(f"{k}:")
                for k2, v2 in v.items():
                    print(f"  {k2}: {v2}")
            else:
                print(f"{k}: {v}")
    return 0


def _checkpoint_info(log: Log) -> dict[str, Any] | None:
    store = _store(log.directory)
    found = store.list()
    if not found:
        return None
    newest = found[0]
    info: dict[str, Any] = {"path": newest.path, "woid": newest.woid, "bytes": newest.size, "count": len(found)}
    try:
        snap = store.load(newest, log.crc_kind, log.channel_id)
        info["age_seconds"] = round(max(0.0, time.time() - snap.created_ns / 1e9), 3)
        info["events"] = len(snap)
        info["valid"] = True
    except (ChannelError, OSError) as exc:
        info["valid"] = False
        info["problem"] = str(exc)
    return info


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Write a checkpoint now."""
    _existing(args.dir)
    with FileChannel(args.dir, ChannelConfig.from_options({"checkpoint_interval": 0})) as ch:
        res = ch.checkpoint()
    print(f"checkpoint at write-order id {res['woid']}: {res['events']} events, {res['bytes']} bytes")
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    """Print every record as a JSON line."""
    _existing(args.dir)
    log = Log(args.dir, ChannelConfig(), readonly=True)
    try:
        records = list(log.replay())
        positions: dict[tuple[int, int], int] = {}
        puts: dict[int, list[tuple[int, int]]] = {}
        for r in records:
            if r.op == fmt.PUT:
                puts.setdefault(r.txn_id, []).append((r.file_id, r.offset))
            elif r.op == fmt.COMMIT:
                first, _n, _t = fmt.decode_commit(r.payload)
                for i, key in enumerate(puts.pop(r.txn_id, [])):
                    positions[key] = first + i
        out = sys.stdout
        for r in records:
            rec: dict[str, Any] = {
                "op": fmt.OP_NAMES[r.op],
                "woid": r.woid,
                "txn": r.txn_id,
                "file": os.path.basename(log.file_path(r.file_id)),
                "offset": r.offset,
                "size": r.size,
            }
            if r.op == fmt.PUT:
                rec["position"] = positions.get((r.file_id, r.offset))
                if args.bodies:
                    body, headers = fmt.decode_event(log.read_payload(r.file_id, r.offset, r.size))
                    rec["headers"] = headers
                    rec["body"] = _body_text(body)
            elif r.op == fmt.COMMIT:
                first, n, t = fmt.decode_commit(r.payload)
                rec.update(first_position=first, puts=n, takes=t)
            elif r.op == fmt.TAKE:
                rec["positions"] = [[a, a + c] for a, c in fmt.decode_take(r.payload)]
            elif r.op == fmt.ROLLBACK:
                p, t = fmt.decode_rollback(r.payload)
                rec.update(puts=p, takes=t)
            elif r.op == fmt.RETIRE:
                rec["retired_file"] = fmt.decode_retire(r.payload)
            out.write(json.dumps(rec) + "\n")
    finally:
        log.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every header, record and queued event."""
    _existing(args.dir)
    _progress(f"verifying {args.dir} ...")
    log, entries = _readonly_channel_state(args.dir, skip=True)
    problems = [r.describe() for r in log.corruption]
    try:
        # Every queued event must read back and decode.
        for i, (pos, fid, off, size) in enumerate(entries):
            if i and i % 100_000 == 0:
                _progress(f"  checked {i} of {len(entries)} queued events")
            try:
                fmt.decode_event(log.read_payload(fid, off, size))
            except ChannelError as exc:
                problems.append(f"queued event at position {pos}: {exc}")
    finally:
        log.close()
    for path, start, n in log.torn_tails:
        print(f"note: {path}: torn tail of {n} bytes at byte {start} (normal after a crash; truncated on open)")
    for p in problems:
        print(f"problem: {p}")
    if problems:
        print(f"{args.dir}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.dir}: ok, {len(entries)} events queued, {len(log.file_ids())} data files verified")
    return 0


# -- parser -----------------------------------------------------------------------------------


def _opts(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "fsync", None):
        out["fsync"] = args.fsync
    return out


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (also used by the docs test)."""
    p = _Parser(
        prog="filechannel",
        description="Inspect, verify and drive a filechannel directory.",
        epilog=_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"filechannel {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    sp = sub.add_parser("put", help="put one event per stdin line, committed in batches", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory (created if missing)")
    sp.add_argument("--header", action="append", metavar="KEY=VALUE", help="a header for every event (repeatable)")
    sp.add_argument("--batch", type=int, default=1000, help="events per transaction (default 1000)")
    sp.add_argument("--fsync", choices=("commit", "interval"), help="fsync mode (default commit)")
    sp.set_defaults(func=cmd_put)

    sp = sub.add_parser("take", help="print and remove events (one per line)", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("-n", type=int, default=1, help="how many events to take (default 1)")
    sp.add_argument("--wait", type=float, default=0.0, help="seconds to wait for events (default 0)")
    sp.add_argument("--json", action="store_true", help="print position, headers and body as JSON lines")
    sp.set_defaults(func=cmd_take)

    sp = sub.add_parser("stat", help="queue size, positions, files, bytes, last write-order id", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.set_defaults(func=cmd_stat)

    sp = sub.add_parser("checkpoint", help="write a checkpoint now (fast restart)", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory")
    sp.set_defaults(func=cmd_checkpoint)

    sp = sub.add_parser("dump", help="print every log record as a JSON line", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--bodies", action="store_true", help="include event headers and bodies")
    sp.set_defaults(func=cmd_dump)

    sp = sub.add_parser("verify", help="check every record and header; exit 1 on problems", epilog=_EPILOG)
    sp.add_argument("dir", help="channel directory")
    sp.set_defaults(func=cmd_verify)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("n", "batch"):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            parser.error(f"--{name if name != 'n' else 'n'} must be positive")
    try:
        return int(args.func(args))
    except BrokenPipeError:  # pragma: no cover - e.g. `| head`
        return 0
    except (ChannelError, OSError) as exc:
        print(f"filechannel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
