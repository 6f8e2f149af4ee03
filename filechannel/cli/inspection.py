"""Inspection and repair: ``stat``, ``consumers``, ``dump``, ``verify``, ``repair-channel-file`` and ``wal``.

Every command here but ``consumers --remove/--reset`` and
``repair-channel-file`` is read-only: it reads the channel through a
read-only view (no lock, no writer) and reports damage itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

from filechannel import format as fmt
from filechannel._fs import DEFAULT_FS, read_file
from filechannel._runs import RunQueue
from filechannel.channel import FileChannel
from filechannel.checkpoint import CHECKPOINT_DIR, CheckpointStore
from filechannel.config import ChannelConfig
from filechannel.consumers import ConsumerState, ConsumerStore, validate_name
from filechannel.crypto import Encryption
from filechannel.directory import CHANNEL_FILE, WAL_FILE
from filechannel.errors import ChannelError, ConfigError, CorruptLogError, DecryptionError, NotAChannelError
from filechannel.log import Log, LogRecord, format_ranges
from filechannel.logview import open_view
from filechannel.repair import channel_file_damaged, rebuild_channel_file
from filechannel.replay import read_event
from filechannel.verify import VerifyResult, verify_channel
from filechannel.wal import dump_wal, verify_wal

from .cli import echo
from .common import body_fields, encryption_of, existing_channel, in_use, progress_line, room_args


def _store(directory: str) -> CheckpointStore:
    return CheckpointStore(DEFAULT_FS, os.path.join(directory, CHECKPOINT_DIR))


def _readonly_channel_state(directory: str, encryption: Encryption | None = None) -> tuple[Log, RunQueue]:
    view = open_view(
        directory,
        ChannelConfig(encryption=encryption),
        progress=progress_line if sys.stderr.isatty() else None,
        keyless_ok=True,
    )
    return view.log, view.replay()


def _head_and_tail(queue: RunQueue) -> tuple[int | None, int | None]:
    """The first and last queued positions, from the queue's runs (no data file is read)."""
    runs, entries, _ = queue.stored()  # a run never begins or ends with a hole
    tails = [runs[-1].first + runs[-1].length - 1] if runs else []
    if entries:
        tails.append(entries[-1][0])
    return queue.first_position(), max(tails, default=None)


def cmd_stat(args: argparse.Namespace) -> int:
    """Print the channel's state (``--prometheus``: its metrics)."""
    if args.json and args.prometheus:
        raise ChannelError("--json and --prometheus: give one of them")
    existing_channel(args.dir)
    progress_line(f"reading {args.dir} ...")
    log, queue = _readonly_channel_state(args.dir, encryption_of(args))
    try:
        st = log.stats()
        head, tail = _head_and_tail(queue)
        files = []
        for fid in log.file_ids():
            path = log.file_path(fid)
            files.append({"file_id": fid, "path": path, "bytes": os.path.getsize(path)})
        info: dict[str, Any] = {
            "directory": args.dir,
            "in_use": in_use(args.dir),
            "queue_size": len(queue),
            "head_position": head,
            "tail_position": tail,
            "next_position": log.next_position,
            "last_woid": log.last_woid,
            "files": files,
            "disk_bytes": st["disk_bytes"],
            "data_bytes": st["data_bytes"],
            "disk_free": st["disk_free"],
            # The limits are options of the process that opens the channel (they are not
            # stored): stat shows those given to it, to compare with what the data holds.
            **{k: getattr(args, k) for k in ("max_bytes", "minimum_required_space") if getattr(args, k) is not None},
            "torn_tails": len(log.torn_tails),
            "key_ids_in_use": log.key_ids_in_use(),
            "checkpoint": _checkpoint_info(log),
            "last_open": _last_open(args.dir),
            "accelerator": fmt.accelerator(),
        }
        info.update(_consumers_info(args.dir, log, queue))
        info["stats"] = st
    finally:
        log.close()
    if args.prometheus:
        sys.stdout.write(_stat_prometheus(args.dir, info))
        return 0
    info.pop("stats")
    if args.json:
        echo(json.dumps(info))
    else:
        for k, v in info.items():
            if k == "files":
                echo(f"files: {len(v)}")
                for f in v:
                    echo(f"  {f['path']}  {f['bytes']} bytes")
            elif k == "consumers":
                echo(f"consumers: {len(v)}")
                for c in v:
                    ident = c["identity"] or "-"
                    echo(
                        f"  {c['name']}: acked {c['acked']}, lag {c['lag_events']} events ({c['lag_bytes']} bytes), "
                        f"identity {ident}, oldest file {c['oldest_file'] or '-'}"
                    )
            elif isinstance(v, dict):
                echo(f"{k}:")
                for k2, v2 in v.items():
                    if k == "last_open" and k2 == "time_iso":
                        continue  # printed as "time"
                    if k == "last_open" and k2 == "time" and "time_iso" in v:
                        v2 = v["time_iso"]
                    echo(f"  {k2}: {v2}")
            else:
                echo(f"{k}: {v}")
    return 0


def _stat_prometheus(directory: str, info: dict[str, Any]) -> str:
    """``stat --prometheus``: the channel's metrics that its files tell (no process counters)."""
    try:
        from filechannel.agent.metrics import ChannelSample, render_samples
    except ImportError as exc:
        raise ChannelError(
            f"--prometheus needs prometheus_client ({exc}): pip install '.[agent]' in filechannel's clone"
        ) from None
    st = info["stats"]
    s = ChannelSample(os.path.basename(os.path.normpath(directory)))
    s.values["channel_size"] = float(info["queue_size"])
    s.values["next_position"] = float(info["next_position"])
    s.values["disk_bytes"] = float(st["disk_bytes"])
    s.values["data_bytes"] = float(st["data_bytes"])
    if st["disk_free"] is not None:
        s.values["disk_free_bytes"] = float(st["disk_free"])
    for key, metric in (("max_bytes", "max_bytes"), ("minimum_required_space", "min_free_bytes")):
        if info.get(key) is not None:
            s.values[metric] = float(info[key])
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


def _consumers_info(directory: str, log: Log, queue: RunQueue) -> dict[str, Any]:
    """Return ``consumers`` (and ``consumers_problem`` if the registry is damaged) for ``stat``."""
    out: dict[str, Any] = {}
    try:
        registry = ConsumerStore(DEFAULT_FS, directory).list()
    except CorruptLogError as exc:
        registry = {}
        out["consumers_problem"] = str(exc)
    out["consumers"] = _consumer_rows(registry, log, queue)
    return out


def _consumer_rows(registry: dict[str, ConsumerState], log: Log, queue: RunQueue) -> list[dict[str, Any]]:
    """One object per consumer, the same in ``stat`` and ``consumers`` (sorted by name).

    Its name, acknowledged position, identity, registration time, the queued events and
    bytes at or after its position, and the data file of the oldest of them (which it
    keeps from retiring; None when it has none). Counts and files come from the
    queue's runs; the bytes from one walk of the queue from the lowest position
    (a chunk of pointers at a time, never a list of every event).
    """
    lag_bytes = _bytes_at_or_after(queue, sorted({c.acked for c in registry.values()}))
    size = len(queue)
    rows = []
    for name in sorted(registry):
        c = registry[name]
        oldest = queue.first_file_at_or_after(c.acked)
        rows.append(
            {
                "name": name,
                "acked": c.acked,
                "identity": c.identity,
                "registered_ns": c.registered_ns,
                "lag_events": size - queue.count_below(c.acked),
                "lag_bytes": lag_bytes[c.acked],
                "oldest_file": log.file_path(oldest[1]) if oldest is not None else None,
            }
        )
    return rows


def _bytes_at_or_after(queue: RunQueue, marks: list[int]) -> dict[int, int]:
    """For each of ``marks`` (sorted): the record bytes of the queued events at or after it (one walk)."""
    if not marks:
        return {}
    buckets = [0] * (len(marks) + 1)  # buckets[k]: events with marks[k - 1] <= position < marks[k]
    k = 0
    for position, _, _, size in queue:
        while k < len(marks) and marks[k] <= position:
            k += 1
        buckets[k] += size
    out: dict[int, int] = {}
    total = 0
    for i in range(len(marks), 0, -1):
        total += buckets[i]
        out[marks[i - 1]] = total
    return out


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
    existing_channel(args.dir)
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
            echo(json.dumps({"directory": args.dir, "removed": name, "acked": acked}))
            return 0
        where = f" (it had acknowledged up to position {before.acked})" if before is not None else ""
        echo(f"removed consumer {name}{where}; the owner no longer waits for it")
        return 0
    if args.reset is not None:
        return _reset_consumer(args)
    if args.to_earliest or args.to_latest or args.to_position is not None or args.dry_run:
        raise ChannelError("--to-earliest, --to-latest, --to-position and --dry-run go with --reset NAME")
    registry = store.list()
    log, queue = _lenient_channel_state(args.dir)
    try:
        rows = _consumer_rows(registry, log, queue)
        next_position = log.next_position
    finally:
        log.close()
    if args.json:
        echo(json.dumps({"directory": args.dir, "next_position": next_position, "consumers": rows}))
        return 0
    if not rows:
        echo(f"{args.dir}: no consumers registered")
        return 0
    echo(f"{'NAME':<20} {'ACKED':>12} {'LAG':>12}  IDENTITY")
    for r in rows:
        echo(f"{r['name']:<20} {r['acked']:>12} {r['lag_events']:>12}  {r['identity'] or '-'}")
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
    enc = encryption_of(args)
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
        echo(json.dumps(plan))
    else:
        verb = "would reset" if args.dry_run else "reset"
        echo(f"{verb} consumer {name}: acknowledged position {cur.acked} -> {to} (channel holds {head} to {end})")
    return 0


def _consumer_names(store: ConsumerStore) -> list[str]:
    """Return the registered consumer names, even when a file is damaged."""
    try:
        return sorted(store.list())
    except CorruptLogError:
        return []


def _lenient_channel_state(directory: str) -> tuple[Log, RunQueue]:
    """The channel's queue as its files say now (read-only, no key needed; lenient about damage)."""
    view = open_view(directory, ChannelConfig(on_corruption="skip"), keyless_ok=True)
    return view.log, view.replay()


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


def cmd_dump(args: argparse.Namespace) -> int:
    """Print every record as a JSON line."""
    existing_channel(args.dir)
    log = open_view(
        args.dir, ChannelConfig(encryption=encryption_of(args)), checkpoints=False, replay=False, keyless_ok=True
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
                rec.update(body_fields(body))
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
    existing_channel(args.dir)
    progress_line(f"verifying {args.dir} ...")
    if args.salvage and os.path.exists(args.salvage) and os.listdir(args.salvage):
        raise ChannelError(f"--salvage {args.salvage}: the destination must be a new or empty directory")
    enc = encryption_of(args)
    res = verify_channel(args.dir, progress=progress_line if sys.stderr.isatty() else None, encryption=enc)
    if args.json:
        return _verify_json(args, res, enc)
    if res.undecrypted:
        echo(
            f"note: {res.undecrypted} encrypted events checked by checksum only (key ids "
            f"{', '.join(res.key_ids)}); give --keystore to check their authentication tags too"
        )
    for path, start, n in res.torn_tails:
        echo(f"note: {path}: torn tail of {n} bytes at byte {start} (normal after a crash; truncated on open)")
    for rep in res.reports:
        echo(f"problem: {rep.describe()}")
    for line in res.latent:
        echo(f"latent: {line}")
    lost = res.lost_positions
    if lost:
        echo(f"lost positions: {format_ranges(lost)} ({sum(b - a for a, b in lost)} events)")
    if args.salvage:
        n = _salvage(args.dir, res, args.salvage, enc)
        echo(f"salvaged {n} intact events into {args.salvage} (positions renumbered from 0, order kept)")
    if not res.ok:
        echo(f"{args.dir}: {len(res.reports) + len(res.latent)} problem(s)", file=sys.stderr)
        return 1
    echo(f"{args.dir}: ok, {len(res.queued)} events queued, {res.files} data files verified")
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
    echo(json.dumps(out))
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
    existing_channel(args.dir)
    res = rebuild_channel_file(args.dir)
    if not res.rebuilt:
        echo(f"{res.path} is intact (channel id {res.channel_id.hex()}); nothing to repair")
        return 0
    echo(
        f"rebuilt {res.path}: channel id {res.channel_id.hex()}, "
        f"checksum kind {_CRC_NAMES.get(res.crc_kind, res.crc_kind)}, "
        f"as {len(res.identity_files)} DATADIR file(s) and {len(res.headers)} data file header(s) agree; "
        f"the damaged file is kept as {res.damaged_copy}"
    )
    if res.unreadable:
        echo(
            f"note: {len(res.unreadable)} data file header(s) did not decode and were not used: "
            f"run `filechannel verify {args.dir}`"
        )
    return 0


_CRC_NAMES = {fmt.CRC32C: "crc32c", fmt.CRC32_ZLIB: "crc32 (zlib)"}


def damaged_channel_file(exc: CorruptLogError, args: argparse.Namespace) -> bool:
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
    for rec in dump_wal(_existing_wal(args.dir), encryption=encryption_of(args)):
        data = rec.pop("data", None)
        if data is not None and args.data:
            rec.update(body_fields(data, "data"))
        out.write(json.dumps(rec) + "\n")
    return 0


def cmd_wal_verify(args: argparse.Namespace) -> int:
    """Check every header, record and time span of a write-ahead log, read-only."""
    rep = verify_wal(_existing_wal(args.dir), encryption=encryption_of(args))
    for line in rep.notes:
        echo(f"note: {line}")
    for line in rep.problems:
        echo(f"problem: {line}")
    if not rep.ok:
        echo(f"{args.dir}: {len(rep.problems)} problem(s)", file=sys.stderr)
        return 1
    echo(f"{args.dir}: ok, {rep.records} records ({rep.bytes} bytes) in {rep.files} data files verified")
    return 0


def stat_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel stat``."""
    sp.add_argument(
        "--prometheus",
        action="store_true",
        help="print the channel's metrics in the Prometheus text format (docs/agents.md#metrics)",
    )
    room_args(sp, "show the limit the channel's owner uses beside what it holds: ")


def consumers_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel consumers``."""
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


def dump_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel dump``."""
    sp.add_argument("--bodies", action="store_true", help="include event headers and bodies")


def verify_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel verify``."""
    sp.add_argument(
        "--salvage",
        metavar="DEST",
        help="copy every intact queued event into a new channel DEST (positions renumbered)",
    )


def wal_dump_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel wal dump``."""
    sp.add_argument("--data", action="store_true", help="include each record's bytes")
