"""The ``filechannel`` command: put, take, stat, dump, verify, checkpoint, consumers.

This is the only module that prints. Every ``ChannelError`` and ``OSError``
becomes one line on stderr and a non-zero exit status, never a traceback.
Exit status: 0 success, 1 verify found problems or take's output closed (its
batch rolled back), 2 usage or channel error, 130 interrupted (SIGINT) and 143
terminated (SIGTERM): ``put`` and ``take`` then say exactly what was committed.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timezone
from typing import Any, NoReturn

from . import format as fmt
from ._fs import DEFAULT_FS, is_locked, read_file, write_private_file
from ._version import __version__
from .channel import FileChannel
from .checkpoint import CHECKPOINT_DIR, CheckpointStore
from .config import ChannelConfig
from .consumers import ConsumerState, ConsumerStore, validate_name
from .crypto import KEY_HINT, Encryption, check_key_id, could_be_key, keystore_json, load_keystore
from .directory import CHANNEL_FILE, LOCK_FILE, WAL_FILE
from .errors import WRONG_KEY, ChannelError, ConfigError, CorruptLogError, DecryptionError, NotAChannelError
from .log import Log, LogRecord, format_ranges
from .logview import open_view
from .reader import ChannelReader
from .repair import channel_file_damaged, rebuild_channel_file
from .replay import read_event
from .verify import VerifyResult, verify_channel
from .wal import dump_wal, verify_wal

_EPILOG = (
    "Exit status: 0 on success, 1 when verify finds problems or take's output closed early (its batch rolled back), "
    "2 on bad input or a channel error, 130 when interrupted (SIGINT), 143 when terminated (SIGTERM)."
)
_STOPPED = "130 when interrupted (SIGINT), 143 when terminated (SIGTERM)"


def _epilog(one: str | None = None, stopped: str = _STOPPED) -> str:
    """One command's exit-status paragraph: what applies to it only (``one``: when it exits 1)."""
    codes = ["0 on success", *([f"1 {one}"] if one else []), "2 on bad input or a channel error", stopped]
    return "Exit status: " + ", ".join(codes) + "."


_TAKE_BATCH = 1000  # events per take transaction unless --transaction-capacity says otherwise


def _existing(path: str) -> str:
    if not os.path.exists(path):
        raise ChannelError(
            f"{path}: no such channel directory (create one with `filechannel put {path}` or filechannel.open)"
        )
    if not os.path.isdir(path):
        raise NotAChannelError(path, "it is a file")
    if not os.path.exists(os.path.join(path, CHANNEL_FILE)):
        raise NotAChannelError(path, "no CHANNEL file (create a channel with `filechannel put` or filechannel.open)")
    if os.path.exists(os.path.join(path, WAL_FILE)):
        raise NotAChannelError(
            path, f"it is a write-ahead log; inspect it with `filechannel wal dump {path}` or `filechannel wal verify`"
        )
    return path


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _body_fields(body: bytes, key: str = "body") -> dict[str, str]:
    """``body`` for a JSON line: ``{key: text, key_encoding: "utf-8"}``, or base64 with ``"base64"``.

    The encoding is always given, so no text can pass for bytes (``"base64:gIE="``
    and the bytes ``80 81`` print differently).
    """
    try:
        return {key: body.decode("utf-8"), f"{key}_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {key: base64.b64encode(body).decode("ascii"), f"{key}_encoding": "base64"}


def _in_use(directory: str) -> bool:
    """Return whether a process holds the channel's lock (read-only: creates and writes nothing)."""
    return is_locked(os.path.join(directory, LOCK_FILE))


def _progress(msg: str) -> None:
    if sys.stderr.isatty():
        print(msg, file=sys.stderr)


def _slow_open_progress(after: float = 2.0) -> Callable[[str], None] | None:
    """What tells a terminal which file a long recovery reads: silent for the first ``after`` seconds.

    None when stderr is not a terminal (scripts get no progress lines).
    """
    if not sys.stderr.isatty():
        return None
    t0 = time.monotonic()
    said = False

    def progress(msg: str) -> None:
        nonlocal said
        if time.monotonic() - t0 >= after:
            if not said:
                print("filechannel: the open is recovering the channel (reading its data files) ...", file=sys.stderr)
                said = True
            print(f"filechannel: {msg}", file=sys.stderr)

    return progress


class _WarningLine(logging.Formatter):
    """One line per record (``filechannel: warning: ...``, ``filechannel: info: ...``), never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        kind = "warning" if record.levelno >= logging.WARNING else record.levelname.lower()
        return f"filechannel: {kind}: " + " ".join(record.getMessage().split("\n"))


@contextmanager
def _library_warnings(level: int = logging.WARNING) -> Iterator[None]:
    """Show the library's records from ``level`` on (default WARNING) on stderr while a command runs.

    The package logger has only a NullHandler, so without this a loss the library
    reports (a record dropped with ``on_corruption="skip"``, when opening or when
    taking, a truncated tail, an unusable checkpoint) would go unseen.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(_WarningLine())
    pkg = logging.getLogger("filechannel")
    old = pkg.level
    if level < logging.WARNING:
        pkg.setLevel(level)
    pkg.addHandler(handler)
    try:
        yield
    finally:
        pkg.removeHandler(handler)
        pkg.setLevel(old)


def _log_level(args: argparse.Namespace) -> int | None:
    """The level ``--log-level`` or ``-v`` asks for (None: neither was given)."""
    if args.log_level is not None:
        return int(getattr(logging, args.log_level.upper()))
    if args.verbose:
        return logging.INFO if args.verbose == 1 else logging.DEBUG
    return None


class _Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where the command may stop (``signum`` says which)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stopped_by(exc: KeyboardInterrupt) -> tuple[str, int]:
    """Return how a summary names the signal (``interrupted``...) and the exit status (128 + its number)."""
    signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
    if signum == signal.SIGINT:
        return "interrupted", 130
    return f"interrupted by {signal.Signals(signum).name}", 128 + signum


class _Sigint:
    """Hold Ctrl-C (SIGINT) and SIGTERM back while the channel commits, so the summary's count is exact.

    Outside :meth:`held`, either signal raises :class:`_Stopped` (a
    ``KeyboardInterrupt``) at once (also while blocked reading stdin or
    printing). Inside, it is remembered and raised when the block ends, after
    the commit (or rollback) and its count are done: a signal never lands
    half-way through the channel's own bookkeeping, and a batch is either
    counted as committed or it was rolled back.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._depth = 0
        self._pending: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Sigint:
        # Only the main thread may set handlers; a signal the parent ignores stays ignored.
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)
        self._old.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self._depth:
            if self._pending is None:
                self._pending = signum
        else:
            raise _Stopped(signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Run the block with SIGINT and SIGTERM deferred to its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._pending is not None and not self._depth:
            signum, self._pending = self._pending, None
            raise _Stopped(signum)


# -- commands ---------------------------------------------------------------------------


def _headers(specs: Sequence[str] | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for h in specs or []:
        if "=" not in h:
            raise ChannelError(f"--header {h!r}: expected KEY=VALUE")
        try:
            h.encode("utf-8")
        except UnicodeEncodeError:
            # Bytes that are not UTF-8 reach argv as lone surrogates; headers are strict UTF-8.
            raise ChannelError(
                f"--header {h!r}: not valid UTF-8 text; header keys and values must be UTF-8 "
                "(carry other bytes in the event body)"
            ) from None
        k, v = h.split("=", 1)
        if not k:
            raise ChannelError(f"--header {h!r}: the key is empty; expected KEY=VALUE with a non-empty KEY")
        headers[k] = v
    return headers


def cmd_put(args: argparse.Namespace) -> int:
    """Put one event per stdin line, committing every ``--batch`` lines.

    Every check that can be made before reading input is made first. A line too
    large for ``max_event_size`` stops the command only after the lines before
    it are committed, so no valid line is lost unreported.
    """
    headers = _headers(args.header)
    cfg = ChannelConfig.from_options(_opts(args))
    if args.batch > cfg.transaction_capacity:
        raise ChannelError(
            f"--batch {args.batch} is larger than the transaction capacity {cfg.transaction_capacity}: "
            f"use --batch {cfg.transaction_capacity} or less, or raise --transaction-capacity"
        )
    stdin = getattr(sys.stdin, "buffer", None)
    if stdin is None:
        raise ChannelError("no standard input to read events from")
    overhead = len(fmt.encode_event(b"", headers))  # an event's size is its line plus this
    limit = cfg.max_event_size
    committed = 0
    batch: list[bytes] = []
    too_big: tuple[int, int, bool] | None = None  # (line number, event size, line cut short)
    new = not os.path.exists(os.path.join(args.dir, CHANNEL_FILE))
    with _Sigint() as sigint:
        try:
            ch = FileChannel(args.dir, cfg, progress=_slow_open_progress())
            try:
                for lineno, line in enumerate(_lines(stdin, limit - overhead), 1):
                    body = line[:-1] if line[-1:] == b"\n" else line
                    if len(body) + overhead > limit:
                        cut = line[-1:] != b"\n" and len(line) >= limit - overhead + 2  # read no further
                        too_big = (lineno, len(body) + overhead, cut)
                        break
                    batch.append(body)
                    if len(batch) >= args.batch:
                        with sigint.held():
                            committed += _put_batch(ch, batch, headers)
                            batch = []
                with sigint.held():
                    committed += _put_batch(ch, batch, headers)
                    batch = []
            except (ChannelError, OSError) as exc:
                raise ChannelError(
                    f"{exc} (the first {committed} lines were committed; the {len(batch)} lines of the batch in "
                    "progress were not)"
                ) from exc
            finally:
                with sigint.held():
                    ch.close()
        except KeyboardInterrupt as exc:
            what, status = _stopped_by(exc)
            print(
                f"filechannel: {what}: {committed} events committed (the first {committed} lines); "
                f"the batch in progress ({len(batch)} lines) was rolled back",
                file=sys.stderr,
            )
            return status
    if too_big is not None:
        lineno, size, cut = too_big
        what = f"more than {limit} bytes" if cut else f"{size} bytes"
        raise ChannelError(
            f"line {lineno}: an event of {what} (line plus headers) exceeds max_event_size={limit}; "
            f"the {committed} lines before it were committed and nothing from line {lineno} on was put "
            "(raise --max-event-size, or split the line)"
        )
    if args.json:
        print(json.dumps({"directory": args.dir, "created": new, "events": committed}))
    else:
        # A mistyped path would otherwise silently become a channel: say so.
        created = f" (created the new channel {args.dir})" if new else ""
        print(f"put {committed} events{created}", file=sys.stderr)
    return 0


def _lines(stream: Any, cap: int) -> Iterator[bytes]:
    """The lines of ``stream``, each read with a bound: a line longer than ``cap`` bytes ends early.

    A line cut at ``cap + 2`` bytes (without its newline) is longer than ``cap``, so
    ``put`` refuses it having read no more of it than that (not a 100 MB line whole).
    """
    readline = getattr(stream, "readline", None)
    if readline is None:  # an iterable of lines (a test's stand-in for stdin)
        yield from stream
        return
    while True:
        line = readline(max(cap, 0) + 2)
        if not line:
            return
        yield line


def _put_batch(ch: FileChannel, batch: list[bytes], headers: dict[str, str]) -> int:
    if not batch:
        return 0
    with ch.transaction() as tx:
        tx.put_many(batch, headers=headers or None)
    return len(batch)


class _OutputFailed(Exception):
    """Writing or flushing ``take``'s output failed; its batch (``events``) was rolled back."""

    def __init__(self, events: int) -> None:
        super().__init__(events)
        self.events = events


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null after EPIPE, so the flush at exit cannot fail again (Python docs, signal)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # not a real file (tests capture it)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _write_raw(out: Any, body: bytes) -> None:
    """Write ``body``'s bytes as they are, then a newline: the line ``put`` read (take undoes put)."""
    raw = getattr(out, "buffer", None)
    if raw is None:  # a text-only stream (a test's): bytes that are not UTF-8 cannot be shown as they are
        out.write(body.decode("utf-8", "surrogateescape") + "\n")
        return
    out.flush()  # text written before stays before
    raw.write(body + b"\n")


def cmd_take(args: argparse.Namespace) -> int:
    """Print and remove events, one transaction per batch.

    Events are printed and flushed before their transaction commits: an
    interrupt, an error or output that could not be fully written (a closed
    pipe) rolls the batch in progress back, so printed events may be taken
    again (at least once), never lost. A take whose output failed exits 1.
    """
    opts = _opts(args)
    if args.transaction_capacity is not None and args.capacity is None:
        # take puts nothing, so capacity only has to admit the transaction capacity.
        opts["capacity"] = max(ChannelConfig().capacity, args.transaction_capacity)
    cfg = ChannelConfig.from_options(opts)  # bad options first: they need no channel
    _existing(args.dir)
    per_txn = args.transaction_capacity or _TAKE_BATCH
    taken = 0
    printed = 0  # events of the transaction in progress already printed
    out = sys.stdout
    with _Sigint() as sigint:
        try:
            ch = FileChannel(args.dir, cfg, progress=_slow_open_progress())
            try:
                left = args.n
                deadline = time.monotonic() + args.wait
                while left > 0:
                    # Wait in short slices so that Ctrl-C is never held back for long.
                    slice_ = min(max(0.0, deadline - time.monotonic()), 0.2)
                    with sigint.held():
                        tx = ch.transaction()
                        try:
                            evs = tx.take_batch(min(left, per_txn), timeout=slice_)
                        except BaseException:
                            tx.rollback()
                            raise
                    try:
                        for ev in evs:
                            if args.json:
                                rec = {"position": ev.position, "headers": dict(ev.headers), **_body_fields(ev.body)}
                                out.write(json.dumps(rec) + "\n")
                            else:
                                _write_raw(out, ev.body)
                            printed += 1
                        out.flush()
                    except BaseException as exc:
                        with sigint.held():
                            tx.rollback()
                        if isinstance(exc, OSError):  # the output, not the channel: say what stays queued
                            raise _OutputFailed(len(evs)) from exc
                        raise
                    with sigint.held():
                        tx.commit()  # an empty one writes nothing
                        taken += len(evs)
                        printed = 0
                    if evs:
                        left -= len(evs)
                        deadline = time.monotonic() + args.wait
                    elif time.monotonic() >= deadline:
                        break
            finally:
                with sigint.held():
                    ch.close()
        except KeyboardInterrupt as exc:
            what, status = _stopped_by(exc)
            print(
                f"filechannel: {what}: {taken} events taken and committed; the batch in progress was "
                f"rolled back ({printed} of its events were printed and stay in the channel)",
                file=sys.stderr,
            )
            return status
        except _OutputFailed as exc:
            cause = exc.__cause__
            how = "output closed" if isinstance(cause, BrokenPipeError) else f"output failed ({cause})"
            print(
                f"filechannel: error: {how}: the batch in progress ({exc.events} events) was rolled back and is "
                f"still queued; {taken} events were taken and committed before it",
                file=sys.stderr,
            )
            _stdout_to_devnull()  # what is left in the buffer can never be written: no second failure at exit
            return 1
    return 0


def _store(directory: str) -> CheckpointStore:
    return CheckpointStore(DEFAULT_FS, os.path.join(directory, CHECKPOINT_DIR))


def _readonly_channel_state(
    directory: str, encryption: Encryption | None = None
) -> tuple[Log, list[tuple[int, int, int, int]]]:
    view = open_view(
        directory,
        ChannelConfig(encryption=encryption),
        progress=_progress if sys.stderr.isatty() else None,
        keyless_ok=True,
    )
    return view.log, view.entries()


def cmd_peek(args: argparse.Namespace) -> int:
    """Print the oldest events without taking them (a read-only view: no lock, the owner may keep writing)."""
    _existing(args.dir)
    if args.n <= 0:
        raise ChannelError(f"-n must be a positive number of events, got {args.n}")
    out = sys.stdout
    with ChannelReader(args.dir, encryption=_encryption(args)) as r:
        start, end = r.available()
        if args.start is not None:
            if not start <= args.start <= end:
                raise ChannelError(f"--start {args.start}: the channel holds positions {start} to {end}")
            start = args.start
        stop = min(end, start + args.n)
        done = start
        while done < stop:  # in bounded reads: -n may be large
            evs = r.read(done, stop, limit=1000)
            if not evs:
                break
            for ev in evs:
                if args.json:
                    rec = {"position": ev.position, "headers": dict(ev.headers), **_body_fields(ev.body)}
                    out.write(json.dumps(rec) + "\n")
                else:
                    _write_raw(out, ev.body)
            last = evs[-1].position
            assert last is not None  # a reader's events carry their positions
            done = last + 1
            out.flush()
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    """Print the channel's state (``--prometheus``: its metrics)."""
    if args.json and args.prometheus:
        raise ChannelError("--json and --prometheus: give one of them")
    _existing(args.dir)
    _progress(f"reading {args.dir} ...")
    log, entries = _readonly_channel_state(args.dir, _encryption(args))
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
            "key_ids_in_use": log.key_ids_in_use(),
            "checkpoint": _checkpoint_info(log),
            "last_open": _last_open(args.dir),
            "accelerator": fmt.accelerator(),
        }
        info.update(_consumers_info(args.dir, log, entries))
        info["stats"] = st
    finally:
        log.close()
    if args.prometheus:
        sys.stdout.write(_stat_prometheus(args.dir, info))
        return 0
    info.pop("stats")
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            if k == "files":
                print(f"files: {len(v)}")
                for f in v:
                    print(f"  {f['path']}  {f['bytes']} bytes")
            elif k == "consumers":
                print(f"consumers: {len(v)}")
                for c in v:
                    ident = c["identity"] or "-"
                    print(
                        f"  {c['name']}: acked {c['acked']}, lag {c['lag_events']} events ({c['lag_bytes']} bytes), "
                        f"identity {ident}, oldest file {c['oldest_file'] or '-'}"
                    )
            elif isinstance(v, dict):
                print(f"{k}:")
                for k2, v2 in v.items():
                    if k == "last_open" and k2 == "time_iso":
                        continue  # printed as "time"
                    if k == "last_open" and k2 == "time" and "time_iso" in v:
                        v2 = v["time_iso"]
                    print(f"  {k2}: {v2}")
            else:
                print(f"{k}: {v}")
    return 0


def _stat_prometheus(directory: str, info: dict[str, Any]) -> str:
    """``stat --prometheus``: the channel's metrics that its files tell (no process counters)."""
    try:
        from .agent.metrics import ChannelSample, render_samples
    except ImportError as exc:
        raise ChannelError(
            f"--prometheus needs prometheus_client ({exc}): pip install '.[agent]' in filechannel's clone"
        ) from None
    st = info["stats"]
    s = ChannelSample(os.path.basename(os.path.normpath(directory)))
    s.values["channel_size"] = float(info["queue_size"])
    s.values["next_position"] = float(info["next_position"])
    s.values["disk_bytes"] = float(st["disk_bytes"])
    s.values["data_files"] = float(len(info["files"]))
    ckpt = info["checkpoint"]
    if ckpt is not None:
        s.values["last_checkpoint_bytes"] = float(ckpt["bytes"])
        if "age_seconds" in ckpt:
            s.values["last_checkpoint_timestamp_seconds"] = round(time.time() - ckpt["age_seconds"], 3)
    for c in info["consumers"]:
        s.consumers[c["name"]] = {
            "acked": float(c["acked"]),
            "lag_events": float(c["lag_events"]),
            "lag_bytes": float(c["lag_bytes"]),
        }
    return render_samples([s]).decode()


def _last_open(directory: str) -> dict[str, Any] | None:
    """How the last open recovered, its ``time`` (epoch seconds) also as ISO 8601 (``time_iso``)."""
    info = _store(directory).last_open()
    if info is None:
        return None
    out: dict[str, Any] = dict(info)
    t = out.get("time")
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        out["time_iso"] = datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
    return out


def _consumers_info(directory: str, log: Log, entries: list[tuple[int, int, int, int]]) -> dict[str, Any]:
    """Return ``consumers`` (and ``consumers_problem`` if the registry is damaged) for ``stat``."""
    out: dict[str, Any] = {}
    try:
        registry = ConsumerStore(DEFAULT_FS, directory).list()
    except CorruptLogError as exc:
        registry = {}
        out["consumers_problem"] = str(exc)
    out["consumers"] = _consumer_rows(registry, log, entries)
    return out


def _consumer_rows(
    registry: dict[str, ConsumerState], log: Log, entries: list[tuple[int, int, int, int]]
) -> list[dict[str, Any]]:
    """One object per consumer, the same in ``stat`` and ``consumers`` (sorted by name).

    Its name, acknowledged position, identity, registration time, the queued events and
    bytes at or after its position, and the data file of the oldest of them (which it
    keeps from retiring; None when it has none).
    """
    positions = [e[0] for e in entries]
    rows = []
    for name in sorted(registry):
        c = registry[name]
        i = bisect.bisect_left(positions, c.acked)
        rows.append(
            {
                "name": name,
                "acked": c.acked,
                "identity": c.identity,
                "registered_ns": c.registered_ns,
                "lag_events": len(entries) - i,
                "lag_bytes": sum(e[3] for e in entries[i:]),
                "oldest_file": log.file_path(entries[i][1]) if i < len(entries) else None,
            }
        )
    return rows


def cmd_consumers(args: argparse.Namespace) -> int:
    """List the external consumers with their acknowledged positions and lag, remove one, or reset one."""
    if args.remove is not None:
        resetting = [
            flag
            for flag, given in (
                ("--reset", args.reset is not None),
                ("--to-earliest", args.to_earliest),
                ("--to-latest", args.to_latest),
                ("--to-position", args.to_position is not None),
                ("--dry-run", args.dry_run),
            )
            if given
        ]
        if resetting:
            raise ChannelError(
                f"--remove conflicts with {', '.join(resetting)}: remove a consumer or reset one, in separate runs "
                "(nothing was changed)"
            )
    _existing(args.dir)
    store = ConsumerStore(DEFAULT_FS, args.dir)
    if args.remove is not None:
        try:
            name = validate_name(args.remove)
        except ConfigError as exc:
            raise ChannelError(f"--remove {args.remove!r}: {exc.reason}") from exc
        try:
            before: ConsumerState | None = store.get(name)
        except CorruptLogError:
            before = None  # a damaged file is removed all the same
        if not store.remove(name):
            known = ", ".join(_consumer_names(store)) or "none"
            raise ChannelError(f"{args.dir}: no consumer named {name!r} (registered: {known})")
        if args.json:
            acked = before.acked if before is not None else None
            print(json.dumps({"directory": args.dir, "removed": name, "acked": acked}))
            return 0
        where = f" (it had acknowledged up to position {before.acked})" if before is not None else ""
        print(f"removed consumer {name}{where}; the owner no longer waits for it")
        return 0
    if args.reset is not None:
        return _reset_consumer(args)
    if args.to_earliest or args.to_latest or args.to_position is not None or args.dry_run:
        raise ChannelError("--to-earliest, --to-latest, --to-position and --dry-run go with --reset NAME")
    registry = store.list()
    log, entries = _lenient_channel_state(args.dir)
    try:
        rows = _consumer_rows(registry, log, entries)
        next_position = log.next_position
    finally:
        log.close()
    if args.json:
        print(json.dumps({"directory": args.dir, "next_position": next_position, "consumers": rows}))
        return 0
    if not rows:
        print(f"{args.dir}: no consumers registered")
        return 0
    print(f"{'NAME':<20} {'ACKED':>12} {'LAG':>12}  IDENTITY")
    for r in rows:
        print(f"{r['name']:<20} {r['acked']:>12} {r['lag_events']:>12}  {r['identity'] or '-'}")
    return 0


def _reset_consumer(args: argparse.Namespace) -> int:
    """``consumers DIR --reset NAME --to-...``: move a consumer's acknowledged position (Kafka's --reset-offsets)."""
    try:
        name = validate_name(args.reset)
    except ConfigError as exc:
        raise ChannelError(f"--reset {args.reset!r}: {exc.reason}") from exc
    targets = [t for t in (args.to_earliest, args.to_latest, args.to_position is not None) if t]
    if len(targets) != 1:
        raise ChannelError("--reset NAME needs exactly one of --to-earliest, --to-latest, --to-position N")
    enc = _encryption(args)
    view = open_view(
        args.dir, ChannelConfig(on_corruption="skip", encryption=enc), replay=False, keyless_ok=enc is None
    )
    log = view.log
    try:
        if log.meta_mac is None and (log.key_ids_in_use() or os.path.exists(os.path.join(args.dir, "ANCHOR"))):
            raise ChannelError(
                f"{args.dir} is encrypted: its acknowledgements carry a MAC; pass --keystore PATH to reset one"
            )
        q = view.replay()
        end = log.next_position
        first = q.first_position()
        head = end if first is None else first
        store = ConsumerStore(DEFAULT_FS, args.dir, None, log.meta_mac, log.macs_required, log.consumer_acks)
    finally:
        log.close()
    cur = store.get(name)
    if cur is None:
        known = ", ".join(_consumer_names(store)) or "none"
        raise ChannelError(f"{args.dir}: no consumer named {name!r} (registered: {known})")
    to = head if args.to_earliest else end if args.to_latest else int(args.to_position)
    if not head <= to <= end:
        raise ChannelError(
            f"--to-position {to}: the channel holds positions {head} to {end} (below {head} the owner has "
            "taken the events; above it nothing is committed)"
        )
    plan = {"directory": args.dir, "consumer": name, "from": cur.acked, "to": to, "dry_run": bool(args.dry_run)}
    if not args.dry_run:
        store.reset(name, to)
    if args.json:
        print(json.dumps(plan))
    else:
        verb = "would reset" if args.dry_run else "reset"
        print(f"{verb} consumer {name}: acknowledged position {cur.acked} -> {to} (channel holds {head} to {end})")
    return 0


def _consumer_names(store: ConsumerStore) -> list[str]:
    """Return the registered consumer names, even when a file is damaged."""
    try:
        return sorted(store.list())
    except CorruptLogError:
        return []


def _lenient_channel_state(directory: str) -> tuple[Log, list[tuple[int, int, int, int]]]:
    """The channel's queue as its files say now (read-only, no key needed; lenient about damage)."""
    view = open_view(directory, ChannelConfig(on_corruption="skip"), keyless_ok=True)
    return view.log, view.entries()


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
    with FileChannel(args.dir, ChannelConfig.from_options({**_opts(args), "checkpoint_interval": 0})) as ch:
        res = ch.checkpoint()
    print(f"checkpoint at write-order id {res['woid']}: {res['events']} events, {res['bytes']} bytes")
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    """Print every record as a JSON line."""
    _existing(args.dir)
    log = open_view(
        args.dir, ChannelConfig(encryption=_encryption(args)), checkpoints=False, replay=False, keyless_ok=True
    ).log
    out = sys.stdout

    def emit(r: LogRecord, position: int | None = None) -> None:
        rec: dict[str, Any] = {
            "op": fmt.OP_NAMES[r.op],
            "woid": r.woid,
            "txn": r.txn_id,
            "file": os.path.basename(log.file_path(r.file_id)),
            "offset": r.offset,
            "size": r.size,
        }
        if r.op == fmt.PUT:
            rec["position"] = position
            if args.bodies:
                try:
                    payload = log.read_payload(r.file_id, r.offset, r.size)
                except DecryptionError as exc:
                    if getattr(args, "keystore", None) is not None:
                        raise
                    raise ChannelError(
                        f"{exc.path}: the channel is encrypted: --bodies needs its keys, give --keystore PATH "
                        "(without --bodies, dump needs no key)"
                    ) from exc
                body, headers = fmt.decode_event(payload)
                rec["headers"] = headers
                rec.update(_body_fields(body))
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

    # Streamed: only the records of the transaction in progress wait (a PUT's position is in
    # its COMMIT, which follows it), never the whole log.
    pending: list[LogRecord] = []
    try:
        for r in log.replay():
            if pending and r.txn_id != pending[0].txn_id:
                for q in pending:  # its transaction never committed: no position
                    emit(q)
                pending = []
            if r.op in (fmt.PUT, fmt.TAKE):
                pending.append(r)
                continue
            if r.op == fmt.COMMIT and pending:
                first = fmt.decode_commit(r.payload)[0]
                puts = 0
                for q in pending:
                    emit(q, first + puts if q.op == fmt.PUT else None)
                    puts += q.op == fmt.PUT
            else:
                for q in pending:
                    emit(q)
            pending = []
            emit(r)
        for q in pending:
            emit(q)
    finally:
        log.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every header, record and queued event (the recovery an open performs, read-only)."""
    _existing(args.dir)
    _progress(f"verifying {args.dir} ...")
    if args.salvage and os.path.exists(args.salvage) and os.listdir(args.salvage):
        raise ChannelError(f"--salvage {args.salvage}: the destination must be a new or empty directory")
    enc = _encryption(args)
    res = verify_channel(args.dir, progress=_progress if sys.stderr.isatty() else None, encryption=enc)
    if args.json:
        return _verify_json(args, res, enc)
    if res.undecrypted:
        print(
            f"note: {res.undecrypted} encrypted events checked by checksum only (key ids "
            f"{', '.join(res.key_ids)}); give --keystore to check their authentication tags too"
        )
    for path, start, n in res.torn_tails:
        print(f"note: {path}: torn tail of {n} bytes at byte {start} (normal after a crash; truncated on open)")
    for rep in res.reports:
        print(f"problem: {rep.describe()}")
    for line in res.latent:
        print(f"latent: {line}")
    lost = res.lost_positions
    if lost:
        print(f"lost positions: {format_ranges(lost)} ({sum(b - a for a, b in lost)} events)")
    if args.salvage:
        n = _salvage(args.dir, res, args.salvage, enc)
        print(f"salvaged {n} intact events into {args.salvage} (positions renumbered from 0, order kept)")
    if not res.ok:
        print(f"{args.dir}: {len(res.reports) + len(res.latent)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.dir}: ok, {len(res.queued)} events queued, {res.files} data files verified")
    return 0


def _verify_json(args: argparse.Namespace, res: VerifyResult, enc: Encryption | None) -> int:
    """``verify --json``: one object on stdout, the same exit status as without it."""
    salvaged = _salvage(args.dir, res, args.salvage, enc) if args.salvage else None
    out = {
        "directory": args.dir,
        "ok": res.ok,
        "events_queued": len(res.queued),
        "data_files": res.files,
        "problems": [rep.describe() for rep in res.reports],
        "latent": list(res.latent),
        "torn_tails": [{"path": p, "offset": start, "bytes": n} for p, start, n in res.torn_tails],
        "lost_positions": [[a, b] for a, b in res.lost_positions],
        "lost_events": sum(b - a for a, b in res.lost_positions),
        "checked_by_checksum_only": res.undecrypted,
        "salvaged": salvaged,
        "salvage_dir": args.salvage,
    }
    print(json.dumps(out))
    return 0 if res.ok else 1


def _salvage(src: str, res: VerifyResult, dest: str, encryption: Encryption | None = None) -> int:
    """Copy the intact queued events of ``src`` into a new channel ``dest``, in position order.

    With a keystore, ``dest`` is encrypted too (never a plaintext copy of encrypted events).
    """
    if encryption is None and res.undecrypted:
        raise ChannelError("--salvage of an encrypted channel needs --keystore (its events are copied encrypted)")
    log = open_view(src, ChannelConfig(on_corruption="skip", encryption=encryption), replay=False).log
    n = 0
    try:
        cfg = ChannelConfig(checkpoint_interval=0, minimum_required_space=0, encryption=encryption)
        with FileChannel(dest, cfg) as out:
            batch = out.config.transaction_capacity
            for i in range(0, len(res.queued), batch):
                with out.transaction() as tx:
                    for e in res.queued[i : i + batch]:
                        body, headers = read_event(log, e)
                        tx.put(body, headers=headers)
                        n += 1
    finally:
        log.close()
    return n


def cmd_repair_channel_file(args: argparse.Namespace) -> int:
    """Rebuild a damaged CHANNEL file from the channel id its data directories and data files agree on."""
    _existing(args.dir)
    res = rebuild_channel_file(args.dir)
    if not res.rebuilt:
        print(f"{res.path} is intact (channel id {res.channel_id.hex()}); nothing to repair")
        return 0
    print(
        f"rebuilt {res.path}: channel id {res.channel_id.hex()}, "
        f"checksum kind {_CRC_NAMES.get(res.crc_kind, res.crc_kind)}, "
        f"as {len(res.identity_files)} DATADIR file(s) and {len(res.headers)} data file header(s) agree; "
        f"the damaged file is kept as {res.damaged_copy}"
    )
    if res.unreadable:
        print(
            f"note: {len(res.unreadable)} data file header(s) did not decode and were not used: "
            f"run `filechannel verify {args.dir}`"
        )
    return 0


_CRC_NAMES = {fmt.CRC32C: "crc32c", fmt.CRC32_ZLIB: "crc32 (zlib)"}


def _damaged_channel_file(exc: CorruptLogError, args: argparse.Namespace) -> bool:
    """Whether ``exc`` is about a damaged CHANNEL file of the channel directory the command was given.

    Not an intact one the library refuses (a newer format version): rebuilding that would be wrong.
    """
    directory = getattr(args, "dir", None)
    if directory is None or args.command == "wal":
        return False
    path = os.path.join(directory, CHANNEL_FILE)
    if os.path.normpath(exc.path) != os.path.normpath(path):
        return False
    try:
        return channel_file_damaged(read_file(DEFAULT_FS, path))
    except OSError:
        return False


def _existing_wal(path: str) -> str:
    if not os.path.exists(path):
        raise ChannelError(f"{path}: no such write-ahead log directory (create one with filechannel.WriteAheadLog)")
    if not os.path.isdir(path):
        raise NotAChannelError(path, "it is a file", expected="a write-ahead log")
    if not os.path.exists(os.path.join(path, CHANNEL_FILE)):
        raise NotAChannelError(
            path,
            "no CHANNEL file (create a write-ahead log with filechannel.WriteAheadLog)",
            expected="a write-ahead log",
        )
    if not os.path.exists(os.path.join(path, WAL_FILE)):
        raise NotAChannelError(
            path,
            f"it is a channel; inspect it with `filechannel dump {path}` or `filechannel verify {path}`",
            expected="a write-ahead log",
        )
    return path


def cmd_wal_dump(args: argparse.Namespace) -> int:
    """Print every record of a write-ahead log (and each file's time span) as a JSON line."""
    out = sys.stdout
    for rec in dump_wal(_existing_wal(args.dir), encryption=_encryption(args)):
        data = rec.pop("data", None)
        if data is not None and args.data:
            rec.update(_body_fields(data, "data"))
        out.write(json.dumps(rec) + "\n")
    return 0


def cmd_wal_verify(args: argparse.Namespace) -> int:
    """Check every header, record and time span of a write-ahead log, read-only."""
    rep = verify_wal(_existing_wal(args.dir), encryption=_encryption(args))
    for line in rep.notes:
        print(f"note: {line}")
    for line in rep.problems:
        print(f"problem: {line}")
    if not rep.ok:
        print(f"{args.dir}: {len(rep.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{args.dir}: ok, {rep.records} records ({rep.bytes} bytes) in {rep.files} data files verified")
    return 0


# -- parser -----------------------------------------------------------------------------------


# Channel options the command line can set, and the flag that sets each.
_CONFIG_FLAGS = {
    "capacity": "--capacity",
    "transaction_capacity": "--transaction-capacity",
    "max_event_size": "--max-event-size",
    "fsync": "--fsync",
    "on_corruption": "--on-corruption",
}


def _opts(args: argparse.Namespace) -> dict[str, Any]:
    """Return the channel options given on the command line (the rest keep their defaults)."""
    opts: dict[str, Any] = {}
    flume = getattr(args, "flume_properties", None)
    if flume is not None:
        from .flume import options_from_properties

        mapped = options_from_properties(flume, getattr(args, "flume_channel", None))
        opts.update(mapped.options)  # flags given on the command line win
    opts.update({name: getattr(args, name) for name in _CONFIG_FLAGS if getattr(args, name, None) is not None})
    enc = _encryption(args)
    if enc is not None:
        opts["encryption"] = enc
    return opts


def _encryption(args: argparse.Namespace) -> Encryption | None:
    """The ``--keystore`` given, loaded (its last key is the one new files use), or None."""
    path = getattr(args, "keystore", None)
    return None if path is None else Encryption(keys=path)


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a keystore (mode 0600) with one new random key, or add a key to an existing one.

    Safe under concurrent runs on one keystore (each adds its key: the read-modify-write
    holds ``<keystore>.lock``) and through a symlink (the link's target is rewritten, the
    link is kept). The new file is written mode 0600, fsynced, renamed over the old one,
    and the directory fsynced.
    """
    from .crypto import keystore_lock, show_id  # here, so the module's imports stay as they are

    path = args.keystore
    if could_be_key(path) or could_be_key(os.path.basename(path)):
        # A key pasted in place of the path: never make it a file name (nor repeat it in a message).
        raise ChannelError(
            "the KEYSTORE argument looks like a key (not shown), not a file name: give the keystore's path, "
            "e.g. `filechannel keygen /etc/filechannel/keys.json`"
        )
    key_id = args.id if args.id is not None else time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())
    check_key_id(key_id, "--id")
    real = os.path.realpath(path)  # a symlink's target: rewrite it, keep the link
    with keystore_lock(real):
        keys: dict[str, bytes] = {}
        if os.path.lexists(real):
            keys = load_keystore(real)  # refuses a keystore another user owns or others can access
            if key_id in keys:
                raise ChannelError(f"{path} already holds key id {show_id(key_id)}: choose another --id")
        keys[key_id] = os.urandom(32)
        write_private_file(real, keystore_json(keys))
    target = f" (a link to {real})" if real != os.path.abspath(path) else ""
    print(
        f"{'added' if len(keys) > 1 else 'created'} key {key_id!r} in {path}{target} ({len(keys)} key(s)); "
        "new data files use it (the last key of the keystore) when it is given with --keystore",
        file=sys.stderr,
    )
    return 0


# -- serve (the agent; filechannel.agent) ------------------------------------------------------

_SERVE_FLAGS = {
    "listen": "--listen",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
    "client_ca": "--client-ca",
    "token_file": "--token-file",
    "allow": "--allow",
    "consumers": "--allow-consumer",
    "writers": "--allow-writer",
    "port_file": "--port-file",
    "encryption": "--keystore",
    "directories": "DIR",
    "on_corruption": "--on-corruption",
    "capacity": "--capacity",
    "transaction_capacity": "--transaction-capacity",
    "max_event_size": "--max-event-size",
    "fsync": "--fsync",
    "http": "--http",
    "http_read_timeout": "--http-read-timeout",
    "http_max_body": "--http-max-body",
    "http_idempotency_keys": "--http-idempotency-keys",
    "tail": "--tail",
    "forward": "--forward",
    "syslog": "--syslog",
    "relp": "--relp",
    "syslog_read_timeout": "--syslog-read-timeout",
    "syslog_max_connections": "--syslog-max-connections",
}


def _serve_dirs(specs: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``DIR`` or ``DIR=NAME`` (the name the HTTP port's URLs use): the directories and their names."""
    dirs: list[str] = []
    names: dict[str, str] = {}
    for spec in specs:
        d, sep, name = spec.rpartition("=")
        if not sep or os.path.exists(spec):
            dirs.append(spec)
            continue
        if not d or not re.match(r"^[A-Za-z0-9._-]{1,100}$", name):
            raise ChannelError(f"{spec!r}: give DIR or DIR=NAME, NAME 1 to 100 characters of A-Z a-z 0-9 . _ -")
        dirs.append(d)
        names[d] = name
    return dirs, names


def _serve_allow(specs: Sequence[str] | None) -> dict[str, frozenset[str]]:
    """``--allow NAME`` (every channel) or ``--allow NAME=CHANNEL_ID`` (one channel), as an allow-list."""
    allow: dict[str, set[str]] = {}
    for spec in specs or ():
        name, sep, channel = spec.partition("=")
        if not name or (sep and not channel):
            raise ChannelError(f"--allow {spec!r}: give NAME (a client certificate's name) or NAME=CHANNEL_ID")
        allow.setdefault(channel.lower() if sep else "*", set()).add(name)
    return {k: frozenset(v) for k, v in allow.items()}


def _serve_consumers(specs: Sequence[str] | None) -> dict[str, frozenset[str]]:
    """``--allow-consumer NAME=CONSUMER``: the consumers each certificate name may act as."""
    out: dict[str, set[str]] = {}
    for spec in specs or ():
        name, sep, consumer = spec.partition("=")
        if not name or not sep or not consumer:
            raise ChannelError(
                f"--allow-consumer {spec!r}: give NAME=CONSUMER (a client certificate's name, a consumer name)"
            )
        out.setdefault(name, set()).add(consumer)
    return {k: frozenset(v) for k, v in out.items()}


def _serve_syslog(args: argparse.Namespace) -> Any:
    """``--syslog`` / ``--relp`` and their options as a ``SyslogSettings`` (``agent/syslog_source.py``), or None."""
    if not args.syslog and not args.relp:
        return None
    if not args.writable:
        raise ChannelError(f"{'--syslog' if args.syslog else '--relp'} puts into the channels: give --writable too")
    from .agent.syslog_source import SyslogSettings

    return SyslogSettings(
        tuple(args.syslog or ()),
        tuple(args.relp or ()),
        read_timeout=args.syslog_read_timeout,
        max_connections=args.syslog_max_connections,
    )


_SERVE_CHANNEL_FLAGS = ("capacity", "transaction_capacity", "max_event_size", "fsync")


def _serve_channel_options(args: argparse.Namespace) -> dict[str, Any]:
    """The channel options of ``serve --writable`` (``--capacity``, ...); refused without ``--writable``."""
    given = {n: getattr(args, n) for n in _SERVE_CHANNEL_FLAGS if getattr(args, n, None) is not None}
    if given and not args.writable:
        flag = _CONFIG_FLAGS[next(iter(given))]
        raise ChannelError(f"{flag} applies to the channels an agent owns: add --writable (or drop {flag})")
    return given


def _serve_forward(args: argparse.Namespace) -> Any:
    """The ``ForwardSettings`` of ``--forward`` (msgpack and ``--writable`` checked now), else None."""
    if not args.forward:
        return None
    if not args.writable:
        raise ChannelError("--forward puts into the channels: give --writable too")
    try:
        from .agent.forward import ForwardSettings
    except ImportError as exc:
        raise ChannelError(
            f"--forward needs msgpack ({exc}): pip install '.[sources]' in filechannel's clone"
        ) from None
    return ForwardSettings(tuple(args.forward))


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve channels over Arrow Flight until SIGTERM or SIGINT (``--check``: print what it would serve)."""
    try:
        from .agent.server import AgentConfig, check, serve
    except ImportError as exc:
        raise ChannelError(
            f"filechannel serve needs pyarrow with Arrow Flight ({exc}): pip install '.[agent]' in filechannel's clone"
        ) from None
    dirs, names = _serve_dirs(args.dir)
    for d in dirs:
        _existing(d)
    http = None
    if args.http is not None:
        try:
            from .agent.web import HttpSettings
        except ImportError as exc:
            raise ChannelError(
                f"--http needs aiohttp and prometheus_client ({exc}): pip install '.[agent]' in filechannel's clone"
            ) from None
        http = HttpSettings(
            args.http,
            port_file=args.http_port_file,
            read_timeout=args.http_read_timeout,
            max_body=args.http_max_body,
            idempotency_keys=args.http_idempotency_keys,
        )
    elif args.http_port_file:
        raise ChannelError("--http-port-file goes with --http HOST:PORT")
    config = AgentConfig(
        tuple(dirs),
        args.listen,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        client_ca=args.client_ca,
        token_file=args.token_file,
        allow=_serve_allow(args.allow),
        consumers=_serve_consumers(args.allow_consumer),
        writers=frozenset(args.allow_writer or ()),
        keystore=args.keystore,
        port_file=args.port_file,
        on_corruption=args.on_corruption or "fail",
        writable=args.writable,
        channel_options=_serve_channel_options(args),
        names=names,
        http=http,
        insecure_allow_anyone=args.insecure_allow_anyone,
        tail=tuple(args.tail or ()),
        tail_options={"follow_symlinks": True} if args.tail_follow_symlinks else {},
        forward=_serve_forward(args),
        syslog=_serve_syslog(args),
    )
    if args.tail_follow_symlinks and not args.tail:
        raise ChannelError("--tail-follow-symlinks goes with --tail GLOB")
    if args.tail and not args.writable:
        raise ChannelError("--tail puts into the channels: give --writable too")
    try:
        if config.syslog is not None:  # a bad value or a listener the agent's rules refuse: one line, first
            from .agent.syslog_source import check_listener

            for spec in config.syslog.specs():
                check_listener(spec, config)
        if args.check:
            info, problems = check(config)
            for problem in problems:
                line = (
                    f"{_SERVE_FLAGS.get(problem.option, problem.option)}: {problem.reason}"
                    if isinstance(problem, ConfigError)
                    else str(problem)
                )
                print(f"filechannel: error: {line}", file=sys.stderr)
            if problems:
                return 2
            how = ", ".join(
                k
                for k, on in (("TLS", info["tls"]), ("mutual TLS", info["mutual_tls"]), ("bearer token", info["token"]))
                if on
            )
            print(f"would listen on {info['listen']} ({how or 'no TLS: loopback or unix socket only'})")
            if config.forward is not None:
                from .agent.forward import check_forward

                for a in check_forward(config, [c["name"] for c in info["channels"]], config.forward):
                    print(f"would take the forward protocol on {a.scheme}://{a.host}:{a.port} into {a.channel}")
            for ch in info["channels"]:
                consumers = ", ".join(f"{n} (acked {c['acked']})" for n, c in sorted(ch["consumers"].items())) or "none"
                print(
                    f"channel {ch['channel']} {ch['directory']}: positions [{ch['start']}, {ch['end']}), "
                    f"consumers: {consumers}"
                )
            for kind, specs in (("syslog", args.syslog), ("relp", args.relp)):
                for spec in specs or ():
                    print(f"would take {kind} on {spec}")
            return 0
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("filechannel serve: %(levelname)s: %(message)s"))
        pkg = logging.getLogger("filechannel")
        pkg.addHandler(handler)
        pkg.setLevel(_log_level(args) or logging.INFO)
        stop = threading.Event()
        old = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            agent = serve(
                config.directories,
                config.listen,
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
                client_ca=config.client_ca,
                token_file=config.token_file,
                allow=config.allow,
                consumers=config.consumers,
                writers=config.writers,
                keystore=config.keystore,
                port_file=config.port_file,
                on_corruption=config.on_corruption,
                writable=config.writable,
                channel_options=config.channel_options,
                names=config.names,
                http=config.http,
                insecure_allow_anyone=config.insecure_allow_anyone,
                tail=config.tail,
                tail_options=config.tail_options,
                forward=config.forward,
                syslog=config.syslog,
            )
            try:
                while not stop.wait(0.5):
                    if any(t.error is not None for t in agent.tails):
                        raise ChannelError("a tail source stopped (see the log above); the agent stops too")
            finally:
                agent.stop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            pkg.removeHandler(handler)
        return 0
    except ConfigError as exc:
        raise ChannelError(f"{_SERVE_FLAGS.get(exc.option, exc.option)}: {exc.reason}") from None


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser (also used by the docs test)."""
    p = _Parser(
        prog="filechannel",
        description="Inspect, verify and drive a filechannel directory.",
        epilog=_EPILOG,
    )
    p.add_argument("--version", action="version", version=f"filechannel {__version__}")
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the library's log on stderr: -v at INFO, -vv at DEBUG (default: warnings of put, take, checkpoint)",
    )
    _log_level_arg(p, default=None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    sp = sub.add_parser(
        "put",
        help="put one event per stdin line, committed in batches",
        epilog=_epilog(stopped=_STOPPED + "; either way it says what was committed"),
    )
    sp.add_argument("dir", help="channel directory (created if missing)")
    sp.add_argument("--header", action="append", metavar="KEY=VALUE", help="a header for every event (repeatable)")
    sp.add_argument(
        "--batch",
        type=int,
        default=1000,
        metavar="N",
        help="events per transaction (default 1000; at most the transaction capacity)",
    )
    sp.add_argument("--fsync", choices=("commit", "interval"), help="fsync mode (default commit)")
    sp.add_argument(
        "--capacity", type=int, metavar="N", help="most events the channel may hold while putting (default 1000000)"
    )
    sp.add_argument("--transaction-capacity", type=int, metavar="N", help="most events per transaction (default 10000)")
    sp.add_argument(
        "--json",
        action="store_true",
        help="print the outcome as one JSON object on stdout (directory, created, events)",
    )
    sp.add_argument(
        "--max-event-size",
        type=int,
        metavar="BYTES",
        help="largest event, a line plus its headers (default 8 MiB); a longer line stops the command",
    )
    _keystore_arg(sp, writes=True)
    _flume_args(sp)
    sp.set_defaults(func=cmd_put)

    sp = sub.add_parser(
        "take",
        help="print and remove events (one per line)",
        epilog=_epilog("when its output closed early (the batch in progress is rolled back and stays queued)"),
    )
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("-n", type=int, default=1, metavar="N", help="how many events to take (default 1)")
    sp.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="seconds to wait for events (default 0)")
    sp.add_argument("--json", action="store_true", help="print position, headers and body as JSON lines")
    sp.add_argument(
        "--transaction-capacity",
        type=int,
        metavar="N",
        help=f"most events per take transaction (default {_TAKE_BATCH})",
    )
    sp.add_argument(
        "--capacity", type=int, metavar="N", help="the channel's capacity (only needed above 1000000 events per take)"
    )
    sp.add_argument(
        "--on-corruption",
        choices=("fail", "skip"),
        help="fail (default) on damaged data, or skip it: drop what is damaged and report each loss on stderr",
    )
    _keystore_arg(sp, writes=True)
    _flume_args(sp)
    sp.set_defaults(func=cmd_take)

    sp = sub.add_parser("peek", help="print the oldest events without taking them (read-only)", epilog=_epilog())
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("-n", type=int, default=10, metavar="N", help="how many events (default 10)")
    sp.add_argument("--start", type=int, metavar="POS", help="from position POS instead of the oldest")
    sp.add_argument("--json", action="store_true", help="one JSON object per event (body and body_encoding)")
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_peek)

    sp = sub.add_parser("stat", help="queue size, positions, files, bytes, last write-order id", epilog=_epilog())
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--json", action="store_true", help="print one JSON object")
    sp.add_argument(
        "--prometheus",
        action="store_true",
        help="print the channel's metrics in the Prometheus text format (docs/agents.md#metrics)",
    )
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_stat)

    sp = sub.add_parser(
        "consumers",
        help="list external consumers (acknowledged position, lag), remove one, or reset one's position",
        epilog=_epilog(),
    )
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--json", action="store_true", help="print one JSON object (also with --remove)")
    sp.add_argument(
        "--remove",
        metavar="NAME",
        help="unregister consumer NAME: the owner stops waiting for its acknowledgements",
    )
    sp.add_argument(
        "--reset",
        metavar="NAME",
        help="move consumer NAME's acknowledged position (stop its reader first); with one of:",
    )
    sp.add_argument("--to-earliest", action="store_true", help="the oldest event the channel still holds")
    sp.add_argument("--to-latest", action="store_true", help="the end: skip everything committed so far")
    sp.add_argument("--to-position", type=int, metavar="N", help="position N (between the two above)")
    sp.add_argument("--dry-run", action="store_true", help="print what --reset would do, change nothing")
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_consumers)

    sp = sub.add_parser("checkpoint", help="write a checkpoint now (fast restart)", epilog=_epilog())
    sp.add_argument("dir", help="channel directory")
    sp.add_argument(
        "--on-corruption",
        choices=("fail", "skip"),
        help="fail (default) on damaged data, or skip it: drop what is damaged and report each loss on stderr",
    )
    _keystore_arg(sp, writes=True)
    sp.set_defaults(func=cmd_checkpoint)

    sp = sub.add_parser("dump", help="print every log record as a JSON line", epilog=_epilog())
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--bodies", action="store_true", help="include event headers and bodies")
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_dump)

    sp = sub.add_parser(
        "verify", help="check every record and header; exit 1 on problems", epilog=_epilog("when it finds problems")
    )
    sp.add_argument("dir", help="channel directory")
    sp.add_argument("--json", action="store_true", help="print one JSON object (same exit status)")
    sp.add_argument(
        "--salvage",
        metavar="DEST",
        help="copy every intact queued event into a new channel DEST (positions renumbered)",
    )
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser(
        "repair-channel-file",
        help="rebuild a damaged CHANNEL file from the channel id its data directories and data files agree on",
        epilog=_epilog(),
    )
    sp.add_argument("dir", help="channel directory")
    sp.set_defaults(func=cmd_repair_channel_file)

    sp = sub.add_parser(
        "keygen", help="create a keystore (mode 0600) with a new random key, or add one", epilog=_epilog()
    )
    sp.add_argument("keystore", metavar="KEYSTORE", help="keystore file (JSON: key id -> base64 key)")
    sp.add_argument("--id", metavar="ID", help="the new key's id (default: the UTC time, YYYY-MM-DD-HHMMSS)")
    sp.set_defaults(func=cmd_keygen)

    sp = sub.add_parser(
        "serve",
        help="serve channels to other hosts over Arrow Flight (an agent; see docs/agents.md)",
        epilog=_epilog(stopped="0 also when stopped by SIGTERM or SIGINT (it stops gracefully)"),
    )
    sp.add_argument(
        "dir",
        nargs="+",
        metavar="DIR[=NAME]",
        help="channel directories to serve (each channel id once); NAME names it in HTTP URLs (default: base name)",
    )
    sp.add_argument(
        "--config",
        metavar="FILE",
        help="read these options from a TOML file (keys: the long options, and channels = [DIR, ...]); "
        "options on the command line win",
    )
    sp.add_argument(
        "--listen",
        required=True,
        metavar="URI",
        help="grpc+tls://HOST:PORT, grpc://127.0.0.1:PORT (loopback only) or grpc+unix:///PATH; port 0 picks one",
    )
    sp.add_argument("--tls-cert", metavar="FILE", help="the agent's certificate chain (PEM), for grpc+tls")
    sp.add_argument("--tls-key", metavar="FILE", help="the agent's private key (PEM, mode 0600), for grpc+tls")
    sp.add_argument("--client-ca", metavar="FILE", help="require client certificates signed by this CA (mutual TLS)")
    sp.add_argument("--token-file", metavar="FILE", help="require this bearer token (a file of mode 0600)")
    sp.add_argument(
        "--allow",
        action="append",
        metavar="NAME[=CHANNEL_ID]",
        help="with --client-ca: only these client certificate names, on every channel or on one (repeatable)",
    )
    sp.add_argument(
        "--allow-writer",
        action="append",
        metavar="NAME",
        help="with --client-ca: only these certificate names may put, stage and commit a Spark sink's rows, or post "
        "over HTTP (repeatable; default: every name let in)",
    )
    sp.add_argument(
        "--allow-consumer",
        action="append",
        metavar="NAME=CONSUMER",
        help="with --client-ca: certificate NAME may act only as these consumers (repeatable; a name not listed may "
        "act only as consumers no listed name owns)",
    )
    sp.add_argument("--keystore", metavar="PATH", help="keystore of encrypted channels (records still travel sealed)")
    sp.add_argument("--port-file", metavar="FILE", help="write the bound port here once listening (atomically)")
    sp.add_argument("--on-corruption", choices=("fail", "skip"), help="fail (default) on damaged data, or skip it")
    _log_level_arg(sp, default="info; -v and -vv also apply")
    sp.add_argument(
        "--writable",
        action="store_true",
        help="open the channels as their owner (taking the lock) and accept exactly-once puts (DoPut)",
    )
    sp.add_argument("--capacity", type=int, metavar="N", help="with --writable: most events a channel may hold")
    sp.add_argument(
        "--transaction-capacity",
        type=int,
        metavar="N",
        help="with --writable: most events per transaction (a put, a Spark sink batch; default 10000)",
    )
    sp.add_argument(
        "--max-event-size", type=int, metavar="BYTES", help="with --writable: largest event (default 8 MiB)"
    )
    sp.add_argument("--fsync", choices=("commit", "interval"), help="with --writable: fsync mode (default commit)")
    sp.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve HTTP: the HTTP source (POST /v1/channels/NAME/events), /metrics, /healthz, /readyz",
    )
    sp.add_argument("--http-port-file", metavar="FILE", help="write the bound HTTP port here once listening")
    sp.add_argument(
        "--http-read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a client's deadline for its headers, and again for its body (default 30)",
    )
    sp.add_argument(
        "--http-max-body",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="the largest request body taken (default 64 MiB; 413 above)",
    )
    sp.add_argument(
        "--http-idempotency-keys",
        type=int,
        default=1024,
        metavar="N",
        help="Idempotency-Key values remembered per channel, the newest N (1 to 2048; default 1024)",
    )
    sp.add_argument(
        "--tail",
        action="append",
        metavar="[NAME=]GLOB",
        help="with --writable: follow files matching GLOB into the channel NAME (its directory's base name; "
        "optional when one channel is served), exactly once (repeatable; docs/agents.md)",
    )
    sp.add_argument(
        "--tail-follow-symlinks",
        action="store_true",
        help="let --tail follow a symlink to a file outside its glob's directory (default: such a link is "
        "skipped with a warning, so a link to a key or a password file never becomes events)",
    )
    sp.add_argument(
        "--forward",
        action="append",
        metavar="tcp://HOST:PORT[=CHANNEL]",
        help="with --writable: take Fluent's forward protocol (Fluent Bit, Fluentd, fluent-logger) on this "
        "address (tls:// with the agent's certificates) into CHANNEL (repeatable; docs/forward.md)",
    )
    sp.add_argument(
        "--insecure-allow-anyone",
        action="store_true",
        help="listen on an address other hosts reach without --client-ca or --token-file: anyone who can connect "
        "may then read, write and take over consumers (refused without this flag)",
    )
    sp.add_argument(
        "--syslog",
        action="append",
        metavar="tcp://HOST:PORT[=CHANNEL]",
        help="with --writable: a syslog source (RFC 5424/3164, RFC 6587 framing); also tls:// (the agent's "
        "certificates) and udp:// (lossy) (repeatable; docs/syslog.md)",
    )
    sp.add_argument(
        "--relp",
        action="append",
        metavar="tcp://HOST:PORT[=CHANNEL]",
        help="with --writable: a RELP source, each message acknowledged after its durable commit; also tls:// "
        "(repeatable; docs/syslog.md)",
    )
    sp.add_argument(
        "--syslog-read-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a syslog or RELP connection silent this long is closed (default 300)",
    )
    sp.add_argument(
        "--syslog-max-connections",
        type=int,
        default=256,
        metavar="N",
        help="connections open at once per --syslog/--relp listener (default 256; more are closed)",
    )
    sp.add_argument(
        "--check",
        action="store_true",
        help="check everything a start checks, print what would be served and exit (a dry run: binds nothing, "
        "opens no channel as owner, changes nothing on disk; exit 2 with one line per problem)",
    )
    sp.set_defaults(func=cmd_serve)

    _top_args(
        sub.add_parser("top", help="a live view of channels and agents: depth, rates, lag (q quits)", epilog=_epilog())
    )

    sp = sub.add_parser(
        "wal",
        help="inspect a write-ahead log (filechannel.WriteAheadLog)",
        epilog=_epilog("when wal verify finds problems"),
    )
    wsub = sp.add_subparsers(dest="wal_command", metavar="WAL_COMMAND", parser_class=_Parser)
    wsub.required = True
    wp = wsub.add_parser("dump", help="print every record and time span as a JSON line", epilog=_epilog())
    wp.add_argument("dir", help="write-ahead log directory")
    wp.add_argument("--data", action="store_true", help="include each record's bytes")
    _keystore_arg(wp)
    wp.set_defaults(func=cmd_wal_dump)
    wp = wsub.add_parser(
        "verify",
        help="check every record, header and time span; exit 1 on problems",
        epilog=_epilog("when it finds problems"),
    )
    wp.add_argument("dir", help="write-ahead log directory")
    _keystore_arg(wp)
    wp.set_defaults(func=cmd_wal_verify)
    return p


def cmd_top(args: argparse.Namespace) -> int:
    """A live view of channels and agents (``top_screen.py``; what it shows: ``top.py``)."""
    from .top_screen import run
    from .top_sources import DirSource, Source, is_agent_uri, open_agent

    if not args.interval > 0:  # also refuses nan
        raise ChannelError(f"--interval must be a number of seconds > 0, got {args.interval}")
    if args.json and not args.once:
        raise ChannelError("--json goes with --once (one JSON document for scripts)")
    tls = {"tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key, "token_file": args.token_file}
    sources: list[Source] = []
    try:
        for t in args.targets:
            if is_agent_uri(t):
                sources.append(open_agent(t, timeout=args.timeout, **tls))
            else:
                sources.append(DirSource(_existing(t), _encryption(args)))
        if len(sources) == 1:
            sources[0].check()  # one target: a problem is an error; with several, that target's row says it
        screen = not args.once and sys.stdout.isatty() and sys.stdin.isatty()
        with _Sigint():  # SIGTERM too unwinds through curses, which gives the terminal back
            try:
                return run(sources, args.interval, sys.stdout, once=args.once, as_json=args.json, screen=screen)
            except KeyboardInterrupt as exc:
                return _stopped_by(exc)[1]  # a normal way to leave: no message
    finally:
        for s in sources:
            s.close()


def _top_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "targets",
        nargs="+",
        metavar="TARGET",
        help="a channel directory, or an agent: grpc+tls://HOST:PORT (Flight) or http(s)://HOST:PORT (its /metrics)",
    )
    sp.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    sp.add_argument("--once", action="store_true", help="print one view (two samples --interval apart) and exit")
    sp.add_argument("--json", action="store_true", help="with --once: print one JSON document")
    sp.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline of each agent call")
    sp.add_argument("--tls-ca", metavar="FILE", help="CA of the agents' certificates (grpc+tls://)")
    sp.add_argument("--tls-cert", metavar="FILE", help="this client's certificate, for agents with --client-ca")
    sp.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    sp.add_argument("--token-file", metavar="FILE", help="a file holding the agents' bearer token (mode 0600)")
    _keystore_arg(sp)
    sp.set_defaults(func=cmd_top)


def _flume_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--flume-properties",
        metavar="FILE",
        help="take the channel options from a Flume agent's FileChannel configuration (docs/flume.md); "
        "flags given here win",
    )
    sp.add_argument(
        "--flume-channel",
        metavar="NAME",
        help="which channel of --flume-properties (agent.channels.NAME, or NAME); needed when it has several",
    )


def _log_level_arg(p: argparse.ArgumentParser, default: str | None) -> None:
    """``--log-level LEVEL``, one spelling wherever it is given: any case, shown in lower case.

    ``serve`` repeats the global option (``serve DIR --log-level info`` reads naturally); its
    copy sets nothing when absent, so ``filechannel --log-level debug serve DIR`` is not undone.
    """
    where = f"default {default}" if default else "overrides -v"
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=_LOG_LEVELS,
        metavar="LEVEL",
        default=argparse.SUPPRESS if default else None,
        help=f"show the library's log on stderr from LEVEL on ({', '.join(_LOG_LEVELS)}, any case; {where})",
    )


def _keystore_arg(sp: argparse.ArgumentParser, *, writes: bool = False) -> None:
    """``--keystore PATH``; ``writes``: the command writes data files (its last key then seals them)."""
    what = (
        "its last key encrypts new data files, every key it holds decrypts"
        if writes
        else "the keys it holds decrypt and check the channel's files"
    )
    sp.add_argument(
        "--keystore",
        metavar="PATH",
        help=f"keystore file of an encrypted channel (mode 0600; from `filechannel keygen`): {what}",
    )


def _serve_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``serve --config agent.toml``: the file's settings become command-line options placed first.

    Keys are ``serve``'s long options (``listen``, ``tls_cert`` or ``tls-cert``,
    ``writable = true``, ``tail = ["/var/log/*.log"]``...), and ``channels`` the
    directories (``"DIR"`` or ``"DIR=NAME"``). Options given on the command line
    come after them, so they win (repeatable ones add up).
    """
    if not argv or argv[0] != "serve" or "--config" not in argv:
        return argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        parser.error("--config needs a FILE")
    path = argv[i + 1]
    rest = argv[1:i] + argv[i + 2 :]
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ImportError:
            parser.error("--config needs Python 3.11+ or the tomli package (the agent extra installs it)")
    try:
        with open(path, "rb") as f:
            conf = tomllib.load(f)
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        parser.error(f"--config {path}: not TOML: {exc}")
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = subs.choices["serve"]
    flags = {s for a in serve._actions for s in a.option_strings if s.startswith("--")}
    out: list[str] = []
    dirs = conf.pop("channels", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        parser.error(f'--config {path}: channels must be a list of directories ("DIR" or "DIR=NAME")')
    for key, value in conf.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in flags or flag == "--config":
            parser.error(f"--config {path}: unknown key {key!r} (the keys are serve's long options, and channels)")
        for v in value if isinstance(value, list) else [value]:
            if v is True:
                out.append(flag)
            elif v is False:
                continue
            elif isinstance(v, (str, int, float)):
                out += [flag, str(v)]
            else:
                parser.error(f"--config {path}: {key} must be a string, a number, true/false or a list of them")
    return ["serve", *dirs, *out, *rest]


def _key_problem(exc: DecryptionError, args: argparse.Namespace) -> str:
    """The line for a key problem, with the command line's advice (``--keystore``) instead of the API's."""
    if exc.wrong_key:
        return (
            f"{WRONG_KEY}: {exc.path}: {exc.reason}; give --keystore PATH with the keystore the channel was "
            "written with (it holds that key id)"
        )
    if exc.hint == KEY_HINT and getattr(args, "keystore", None) is None:
        return (
            f"{exc.path}: the channel is encrypted (key id {exc.key_id!r}) and no --keystore was given: "
            "give --keystore PATH with the keystore it was written with"
        )
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(_serve_config(list(sys.argv[1:] if argv is None else argv), parser))
    for name, flag in (("n", "-n"), ("batch", "--batch")):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            parser.error(f"{flag} must be positive, got {v}")
    wait = getattr(args, "wait", None)
    if wait is not None and not wait >= 0:  # also refuses nan
        parser.error(f"--wait must be a number of seconds >= 0, got {wait}")
    # Commands that open the channel for writing show what the library reports;
    # stat, dump and verify are read-only and report damage themselves.
    level = _log_level(args)
    shown: AbstractContextManager[None] = (
        nullcontext()  # a running agent logs on stderr itself (--log-level), each record once
        if args.func is cmd_serve and not args.check
        else _library_warnings(level)
        if level is not None
        else _library_warnings()
        if args.func in (cmd_put, cmd_take, cmd_checkpoint)
        else nullcontext()
    )
    try:
        with shown:
            return int(args.func(args))
    except BrokenPipeError:  # e.g. `stat | head`; take handles its own (its batch is rolled back)
        _stdout_to_devnull()
        return 0
    except ConfigError as exc:
        # Name the flag the user typed, not the library's option name.
        cli_flag = _CONFIG_FLAGS.get(exc.option)
        given = getattr(args, exc.option, None) if cli_flag else None
        msg = f"{cli_flag} {given}: {exc.reason}" if given is not None else str(exc)
        cap = getattr(args, "capacity", None)
        if exc.option == "transaction_capacity" and given is None and cap is not None:
            # The default transaction capacity did not fit the --capacity the user gave: blame that.
            tc = ChannelConfig().transaction_capacity
            msg = (
                f"--capacity {cap}: below the transaction capacity ({tc}, the default); "
                f"give --capacity {tc} or more, or also --transaction-capacity {cap} or less"
            )
        if exc.option == "encryption":
            ks = getattr(args, "keystore", None)
            if ks is not None and args.func is not cmd_keygen:
                # The value is repeated only when it cannot be a key pasted in place of the path.
                msg = f"--keystore {ks}: {exc.reason}" if not could_be_key(ks) else f"--keystore: {exc.reason}"
            else:
                msg = exc.reason
        print(f"filechannel: error: {msg}", file=sys.stderr)
        return 2
    except (ChannelError, OSError) as exc:
        msg = str(exc)
        if isinstance(exc, DecryptionError) and exc.key_id is not None:
            msg = _key_problem(exc, args)  # --on-corruption skip would not help
        elif isinstance(exc, CorruptLogError) and _damaged_channel_file(exc, args):
            # Neither verify nor --on-corruption skip get past it; the data files may be intact.
            msg = (
                f"{exc.path} at byte {exc.offset}: {exc.reason}: the channel's identity file is damaged "
                f"(the data files may be intact): rebuild it from them with `filechannel repair-channel-file "
                f"{args.dir}` (it keeps a copy of the damaged file)"
            )
        elif isinstance(exc, CorruptLogError) and hasattr(args, "on_corruption"):
            msg += f"; from the command line: filechannel {args.command} DIR --on-corruption skip"
        print(f"filechannel: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("filechannel: interrupted", file=sys.stderr)
        return 130
