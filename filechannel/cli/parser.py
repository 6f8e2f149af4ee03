"""The command line's parser, as a table of subcommands.

Each :class:`Command` names a subcommand, its help line and exit-status
paragraph, the function that runs it and the function that adds its own
options (beside the command it belongs to: ``channels.py``, ``inspection.py``,
``serving.py``, ``top.py``). The arguments many commands share are added here
and nowhere else, from the table's fields: the channel directory (``dir``),
``--json``, ``--keystore`` (for reading, or for writing: its last key then seals
new data files) and ``--on-corruption``. ``wal`` holds a table of its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from filechannel._version import __version__

from . import channels, inspection, serving, top
from .common import EPILOG, STOPPED, Parser, epilog, log_level_arg


@dataclass(frozen=True)
class Command:
    """One subcommand: what ``filechannel --help`` lists, and how its parser is built."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int] | None  # None: a command of subcommands (``sub``)
    add: Callable[[argparse.ArgumentParser], None] | None = None  # the command's own options
    epilog: str = epilog()
    dir: str | None = "channel directory"  # the help of the DIR positional; None: the command takes none
    json: str | None = None  # the help of --json; None: no --json
    keystore: str | None = None  # "read", "write" or None: no --keystore
    on_corruption: bool = False  # --on-corruption fail|skip, for a command that opens the channel as its owner
    sub: tuple[Command, ...] = ()  # subcommands (``wal dump``, ``wal verify``)
    sub_dest: str = ""


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


def _add(sub: argparse._SubParsersAction[Parser], cmd: Command) -> None:
    """Add ``cmd``'s parser to ``sub``: the shared arguments from the table, then the command's own."""
    sp = sub.add_parser(cmd.name, help=cmd.help, epilog=cmd.epilog)
    if cmd.dir is not None:
        sp.add_argument("dir", help=cmd.dir)
    if cmd.add is not None:
        cmd.add(sp)
    if cmd.json is not None:
        sp.add_argument("--json", action="store_true", help=cmd.json)
    if cmd.on_corruption:
        sp.add_argument(
            "--on-corruption",
            choices=("fail", "skip"),
            help="fail (default) on damaged data, or skip it: drop what is damaged and report each loss on stderr",
        )
    if cmd.keystore is not None:
        _keystore_arg(sp, writes=cmd.keystore == "write")
    if cmd.sub:
        nested = sp.add_subparsers(dest=cmd.sub_dest, metavar=cmd.sub_dest.upper(), parser_class=Parser)
        nested.required = True
        for c in cmd.sub:
            _add(nested, c)
    if cmd.run is not None:
        sp.set_defaults(func=cmd.run)


WAL_DIR = "write-ahead log directory"

COMMANDS: tuple[Command, ...] = (
    # channel commands (channels.py)
    Command(
        "put",
        "put one event per stdin line, committed in batches",
        channels.cmd_put,
        channels.put_arguments,
        epilog=epilog(stopped=STOPPED + "; either way it says what was committed"),
        dir="channel directory (created if missing)",
        json="print the outcome as one JSON object on stdout (directory, created, events)",
        keystore="write",
    ),
    Command(
        "take",
        "print and remove events (one per line)",
        channels.cmd_take,
        channels.take_arguments,
        epilog=epilog("when its output closed early (the batch in progress is rolled back and stays queued)"),
        json="print position, headers and body as JSON lines",
        keystore="write",
        on_corruption=True,
    ),
    Command(
        "peek",
        "print the oldest events without taking them (read-only)",
        channels.cmd_peek,
        channels.peek_arguments,
        json="one JSON object per event (body and body_encoding)",
        keystore="read",
    ),
    # inspection and repair (inspection.py)
    Command(
        "stat",
        "queue size, positions, files, bytes, last write-order id",
        inspection.cmd_stat,
        inspection.stat_arguments,
        json="print one JSON object",
        keystore="read",
    ),
    Command(
        "consumers",
        "list external consumers (acknowledged position, lag), remove one, or reset one's position",
        inspection.cmd_consumers,
        inspection.consumers_arguments,
        json="print one JSON object (also with --remove)",
        keystore="read",
    ),
    Command(
        "checkpoint",
        "write a checkpoint now (fast restart)",
        channels.cmd_checkpoint,
        keystore="write",
        on_corruption=True,
    ),
    Command(
        "dump",
        "print every log record as a JSON line",
        inspection.cmd_dump,
        inspection.dump_arguments,
        keystore="read",
    ),
    Command(
        "verify",
        "check every record and header; exit 1 on problems",
        inspection.cmd_verify,
        inspection.verify_arguments,
        epilog=epilog("when it finds problems"),
        json="print one JSON object (same exit status)",
        keystore="read",
    ),
    Command(
        "repair-channel-file",
        "rebuild a damaged CHANNEL file from the channel id its data directories and data files agree on",
        inspection.cmd_repair_channel_file,
    ),
    # serve and keys (serving.py)
    Command(
        "keygen",
        "create a keystore (mode 0600) with a new random key, or add one",
        serving.cmd_keygen,
        serving.keygen_arguments,
        dir=None,
    ),
    Command(
        "serve",
        "serve channels to other hosts over Arrow Flight (an agent; see docs/agents.md)",
        serving.cmd_serve,
        serving.serve_arguments,
        epilog=epilog(stopped="0 also when stopped by SIGTERM or SIGINT (it stops gracefully)"),
        dir=None,
    ),
    # top (top.py)
    Command(
        "top",
        "a live view of channels and agents: depth, rates, lag (q quits)",
        top.cmd_top,
        top.top_arguments,
        dir=None,
        json="with --once: print one JSON document",
        keystore="read",
    ),
    # the write-ahead log (inspection.py)
    Command(
        "wal",
        "inspect a write-ahead log (filechannel.WriteAheadLog)",
        None,
        epilog=epilog("when wal verify finds problems"),
        dir=None,
        sub_dest="wal_command",
        sub=(
            Command(
                "dump",
                "print every record and time span as a JSON line",
                inspection.cmd_wal_dump,
                inspection.wal_dump_arguments,
                dir=WAL_DIR,
                keystore="read",
            ),
            Command(
                "verify",
                "check every record, header and time span; exit 1 on problems",
                inspection.cmd_wal_verify,
                epilog=epilog("when it finds problems"),
                dir=WAL_DIR,
                keystore="read",
            ),
        ),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser: the global options, then a subparser per entry of :data:`COMMANDS`."""
    p = Parser(
        prog="filechannel",
        description="Inspect, verify and drive a filechannel directory.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"filechannel {__version__}")
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the library's log on stderr: -v at INFO, -vv at DEBUG (default: warnings of put, take, checkpoint)",
    )
    log_level_arg(p, default=None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for cmd in COMMANDS:
        _add(sub, cmd)
    return p
