"""The channel commands: ``put``, ``take``, ``peek`` and ``checkpoint``.

``put`` and ``take`` open the channel as its owner and commit in batches;
Ctrl-C or SIGTERM is held while a batch commits, so the summary says exactly
what was committed. ``peek`` reads without taking (no lock); ``checkpoint``
writes a checkpoint now.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from filechannel import format as fmt
from filechannel.channel import FileChannel
from filechannel.config import ChannelConfig
from filechannel.directory import CHANNEL_FILE
from filechannel.errors import ChannelError
from filechannel.reader import ChannelReader

from .cli import echo
from .common import (
    CONFIG_FLAGS,
    Sigint,
    body_fields,
    encryption_of,
    existing_channel,
    flume_args,
    room_args,
    stdout_to_devnull,
    stopped_by,
)

_TAKE_BATCH = 1000  # events per take transaction unless --transaction-capacity says otherwise


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
                echo("filechannel: the open is recovering the channel (reading its data files) ...", file=sys.stderr)
                said = True
            echo(f"filechannel: {msg}", file=sys.stderr)

    return progress


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
    with Sigint() as sigint:
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
            what, status = stopped_by(exc)
            echo(
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
        echo(json.dumps({"directory": args.dir, "created": new, "events": committed}))
    else:
        # A mistyped path would otherwise silently become a channel: say so.
        created = f" (created the new channel {args.dir})" if new else ""
        echo(f"put {committed} events{created}", file=sys.stderr)
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
    existing_channel(args.dir)
    per_txn = args.transaction_capacity or _TAKE_BATCH
    taken = 0
    printed = 0  # events of the transaction in progress already printed
    out = sys.stdout
    with Sigint() as sigint:
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
                                rec = {"position": ev.position, "headers": dict(ev.headers), **body_fields(ev.body)}
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
            what, status = stopped_by(exc)
            echo(
                f"filechannel: {what}: {taken} events taken and committed; the batch in progress was "
                f"rolled back ({printed} of its events were printed and stay in the channel)",
                file=sys.stderr,
            )
            return status
        except _OutputFailed as exc:
            cause = exc.__cause__
            how = "output closed" if isinstance(cause, BrokenPipeError) else f"output failed ({cause})"
            echo(
                f"filechannel: error: {how}: the batch in progress ({exc.events} events) was rolled back and is "
                f"still queued; {taken} events were taken and committed before it",
                file=sys.stderr,
            )
            stdout_to_devnull()  # what is left in the buffer can never be written: no second failure at exit
            return 1
    return 0


def cmd_peek(args: argparse.Namespace) -> int:
    """Print the oldest events without taking them (a read-only view: no lock, the owner may keep writing)."""
    existing_channel(args.dir)
    if args.n <= 0:
        raise ChannelError(f"-n must be a positive number of events, got {args.n}")
    out = sys.stdout
    with ChannelReader(args.dir, encryption=encryption_of(args)) as r:
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
                    rec = {"position": ev.position, "headers": dict(ev.headers), **body_fields(ev.body)}
                    out.write(json.dumps(rec) + "\n")
                else:
                    _write_raw(out, ev.body)
            last = evs[-1].position
            assert last is not None  # a reader's events carry their positions
            done = last + 1
            out.flush()
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Write a checkpoint now."""
    existing_channel(args.dir)
    with FileChannel(args.dir, ChannelConfig.from_options({**_opts(args), "checkpoint_interval": 0})) as ch:
        res = ch.checkpoint()
    echo(f"checkpoint at write-order id {res['woid']}: {res['events']} events, {res['bytes']} bytes")
    return 0


def _opts(args: argparse.Namespace) -> dict[str, Any]:
    """Return the channel options given on the command line (the rest keep their defaults)."""
    opts: dict[str, Any] = {}
    flume = getattr(args, "flume_properties", None)
    if flume is not None:
        from filechannel.flume import options_from_properties

        mapped = options_from_properties(flume, getattr(args, "flume_channel", None))
        opts.update(mapped.options)  # flags given on the command line win
    opts.update({name: getattr(args, name) for name in CONFIG_FLAGS if getattr(args, name, None) is not None})
    enc = encryption_of(args)
    if enc is not None:
        opts["encryption"] = enc
    return opts


def put_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel put``."""
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
    room_args(sp)
    sp.add_argument(
        "--max-event-size",
        type=int,
        metavar="BYTES",
        help="largest event, a line plus its headers (default 8 MiB); a longer line stops the command",
    )
    flume_args(sp)


def take_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel take``."""
    sp.add_argument("-n", type=int, default=1, metavar="N", help="how many events to take (default 1)")
    sp.add_argument("--wait", type=float, default=0.0, metavar="SECONDS", help="seconds to wait for events (default 0)")
    sp.add_argument(
        "--transaction-capacity",
        type=int,
        metavar="N",
        help=f"most events per take transaction (default {_TAKE_BATCH})",
    )
    sp.add_argument(
        "--capacity", type=int, metavar="N", help="the channel's capacity (only needed above 1000000 events per take)"
    )
    flume_args(sp)


def peek_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel peek``."""
    sp.add_argument("-n", type=int, default=10, metavar="N", help="how many events (default 10)")
    sp.add_argument("--start", type=int, metavar="POS", help="from position POS instead of the oldest")
