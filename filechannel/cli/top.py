"""``filechannel top``: a live view of channels and agents (what it shows: ``filechannel/top.py``)."""

from __future__ import annotations

import argparse
import sys

from filechannel.errors import ChannelError

from .common import Sigint, encryption_of, existing_channel, stopped_by


def cmd_top(args: argparse.Namespace) -> int:
    """A live view of channels and agents (``top_screen.py``; what it shows: ``top.py``)."""
    from filechannel.top_screen import run
    from filechannel.top_sources import DirSource, Source, is_agent_uri, open_agent

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
                sources.append(DirSource(existing_channel(t), encryption_of(args)))
        if len(sources) == 1:
            sources[0].check()  # one target: a problem is an error; with several, that target's row says it
        screen = not args.once and sys.stdout.isatty() and sys.stdin.isatty()
        with Sigint():  # SIGTERM too unwinds through curses, which gives the terminal back
            try:
                return run(sources, args.interval, sys.stdout, once=args.once, as_json=args.json, screen=screen)
            except KeyboardInterrupt as exc:
                return stopped_by(exc)[1]  # a normal way to leave: no message
    finally:
        for s in sources:
            s.close()


def top_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel top``."""
    sp.add_argument(
        "targets",
        nargs="+",
        metavar="TARGET",
        help="a channel directory, or an agent: grpc+tls://HOST:PORT (Flight) or http(s)://HOST:PORT (its /metrics)",
    )
    sp.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    sp.add_argument("--once", action="store_true", help="print one view (two samples --interval apart) and exit")
    sp.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline of each agent call")
    sp.add_argument("--tls-ca", metavar="FILE", help="CA of the agents' certificates (grpc+tls://)")
    sp.add_argument("--tls-cert", metavar="FILE", help="this client's certificate, for agents with --client-ca")
    sp.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert")
    sp.add_argument("--token-file", metavar="FILE", help="a file holding the agents' bearer token (mode 0600)")
