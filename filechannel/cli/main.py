"""The ``filechannel`` entry point: parse, run the command, turn every error into one line.

Every ``ChannelError`` and ``OSError`` becomes one line on stderr and a
non-zero exit status, never a traceback; a ``ConfigError`` names the flag the
user typed. This is where the command line's exit statuses are decided.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from filechannel.config import ChannelConfig
from filechannel.crypto import KEY_HINT, could_be_key
from filechannel.errors import WRONG_KEY, ChannelError, ConfigError, CorruptLogError, DecryptionError

from .channels import cmd_checkpoint, cmd_put, cmd_take
from .cli import echo
from .common import CONFIG_FLAGS, library_warnings, log_level_of, stdout_to_devnull
from .inspection import damaged_channel_file
from .parser import build_parser
from .serving import cmd_keygen, cmd_serve, serve_config


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
    args = parser.parse_args(serve_config(list(sys.argv[1:] if argv is None else argv), parser))
    for name, flag in (("n", "-n"), ("batch", "--batch")):
        v = getattr(args, name, None)
        if v is not None and v <= 0:
            parser.error(f"{flag} must be positive, got {v}")
    wait = getattr(args, "wait", None)
    if wait is not None and not wait >= 0:  # also refuses nan
        parser.error(f"--wait must be a number of seconds >= 0, got {wait}")
    # Commands that open the channel for writing show what the library reports;
    # stat, dump and verify are read-only and report damage themselves.
    level = log_level_of(args)
    shown: AbstractContextManager[None] = (
        nullcontext()  # a running agent logs on stderr itself (--log-level), each record once
        if args.func is cmd_serve and not args.check
        else library_warnings(level)
        if level is not None
        else library_warnings()
        if args.func in (cmd_put, cmd_take, cmd_checkpoint)
        else nullcontext()
    )
    try:
        with shown:
            return int(args.func(args))
    except BrokenPipeError:  # e.g. `stat | head`; take handles its own (its batch is rolled back)
        stdout_to_devnull()
        return 0
    except ConfigError as exc:
        # Name the flag the user typed, not the library's option name.
        cli_flag = CONFIG_FLAGS.get(exc.option)
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
        echo(f"filechannel: error: {msg}", file=sys.stderr)
        return 2
    except (ChannelError, OSError) as exc:
        msg = str(exc)
        if isinstance(exc, DecryptionError) and exc.key_id is not None:
            msg = _key_problem(exc, args)  # --on-corruption skip would not help
        elif isinstance(exc, CorruptLogError) and damaged_channel_file(exc, args):
            # Neither verify nor --on-corruption skip get past it; the data files may be intact.
            msg = (
                f"{exc.path} at byte {exc.offset}: {exc.reason}: the channel's identity file is damaged "
                f"(the data files may be intact): rebuild it from them with `filechannel repair-channel-file "
                f"{args.dir}` (it keeps a copy of the damaged file)"
            )
        elif isinstance(exc, CorruptLogError) and hasattr(args, "on_corruption"):
            msg += f"; from the command line: filechannel {args.command} DIR --on-corruption skip"
        echo(f"filechannel: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        echo("filechannel: interrupted", file=sys.stderr)
        return 130
