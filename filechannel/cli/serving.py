"""Serve and keys: ``serve`` (an agent over Arrow Flight, with its HTTP port and sources) and ``keygen``.

``serve`` takes its options from the command line or a TOML file
(``--config``: :func:`serve_config`), checks them all before it binds
anything, and runs until SIGTERM or SIGINT. ``keygen`` creates or extends a
keystore (mode 0600).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from filechannel._fs import write_private_file
from filechannel.crypto import check_key_id, could_be_key, keystore_json, load_keystore
from filechannel.errors import ChannelError, ConfigError

from .cli import echo
from .common import CONFIG_FLAGS, existing_channel, log_level_arg, log_level_of, room_args, size_arg

if TYPE_CHECKING:
    from filechannel.agent.server import AgentConfig


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a keystore (mode 0600) with one new random key, or add a key to an existing one.

    Safe under concurrent runs on one keystore (each adds its key: the read-modify-write
    holds ``<keystore>.lock``) and through a symlink (the link's target is rewritten, the
    link is kept). The new file is written mode 0600, fsynced, renamed over the old one,
    and the directory fsynced.
    """
    from filechannel.crypto import keystore_lock, show_id  # here, so the module's imports stay as they are

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
    echo(
        f"{'added' if len(keys) > 1 else 'created'} key {key_id!r} in {path}{target} ({len(keys)} key(s)); "
        "new data files use it (the last key of the keystore) when it is given with --keystore",
        file=sys.stderr,
    )
    return 0


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
    "max_bytes": "--max-bytes",
    "minimum_required_space": "--min-free-bytes",
    "transaction_capacity": "--transaction-capacity",
    "max_event_size": "--max-event-size",
    "fsync": "--fsync",
    "cache_bytes": "--cache-bytes",
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
    from filechannel.agent.syslog_source import SyslogSettings

    return SyslogSettings(
        tuple(args.syslog or ()),
        tuple(args.relp or ()),
        read_timeout=args.syslog_read_timeout,
        max_connections=args.syslog_max_connections,
    )


_SERVE_CHANNEL_FLAGS = (
    "capacity",
    "max_bytes",
    "minimum_required_space",
    "transaction_capacity",
    "max_event_size",
    "fsync",
    "cache_bytes",
)


def _serve_channel_options(args: argparse.Namespace) -> dict[str, Any]:
    """The channel options of ``serve --writable`` (``--capacity``, ...); refused without ``--writable``."""
    given = {n: getattr(args, n) for n in _SERVE_CHANNEL_FLAGS if getattr(args, n, None) is not None}
    if given and not args.writable:
        flag = CONFIG_FLAGS[next(iter(given))]
        raise ChannelError(f"{flag} applies to the channels an agent owns: add --writable (or drop {flag})")
    return given


def _serve_forward(args: argparse.Namespace) -> Any:
    """The ``ForwardSettings`` of ``--forward`` (msgpack and ``--writable`` checked now), else None."""
    if not args.forward:
        return None
    if not args.writable:
        raise ChannelError("--forward puts into the channels: give --writable too")
    try:
        from filechannel.agent.forward import ForwardSettings
    except ImportError as exc:
        raise ChannelError(
            f"--forward needs msgpack ({exc}): pip install '.[sources]' in filechannel's clone"
        ) from None
    return ForwardSettings(tuple(args.forward))


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve channels over Arrow Flight until SIGTERM or SIGINT (``--check``: print what it would serve)."""
    try:
        from filechannel.agent.server import AgentConfig, check, serve
    except ImportError as exc:
        raise ChannelError(
            f"filechannel serve needs pyarrow with Arrow Flight ({exc}): pip install '.[agent]' in filechannel's clone"
        ) from None
    config = _agent_config(args, AgentConfig)
    if args.tail_follow_symlinks and not args.tail:
        raise ChannelError("--tail-follow-symlinks goes with --tail GLOB")
    if args.tail and not args.writable:
        raise ChannelError("--tail puts into the channels: give --writable too")
    try:
        if config.syslog is not None:  # a bad value or a listener the agent's rules refuse: one line, first
            from filechannel.agent.syslog_source import check_listener

            for spec in config.syslog.specs():
                check_listener(spec, config)
        if args.check:
            return _check(args, config, check)
        return _run(args, config, serve)
    except ConfigError as exc:
        raise ChannelError(f"{_SERVE_FLAGS.get(exc.option, exc.option)}: {exc.reason}") from None


def _agent_config(args: argparse.Namespace, agent_config: type[AgentConfig]) -> AgentConfig:
    """The ``AgentConfig`` of ``serve``'s options (``agent_config``: the class, imported once pyarrow is known)."""
    dirs, names = _serve_dirs(args.dir)
    for d in dirs:
        existing_channel(d)
    http = None
    if args.http is not None:
        try:
            from filechannel.agent.web import HttpSettings
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
    config = agent_config(
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
    return config


def _check(args: argparse.Namespace, config: AgentConfig, check: Callable[..., Any]) -> int:
    """``serve --check``: every problem a start would find (one line each, exit 2), or what would be served."""
    info, problems = check(config)
    for problem in problems:
        line = (
            f"{_SERVE_FLAGS.get(problem.option, problem.option)}: {problem.reason}"
            if isinstance(problem, ConfigError)
            else str(problem)
        )
        echo(f"filechannel: error: {line}", file=sys.stderr)
    if problems:
        return 2
    how = ", ".join(
        k for k, on in (("TLS", info["tls"]), ("mutual TLS", info["mutual_tls"]), ("bearer token", info["token"])) if on
    )
    echo(f"would listen on {info['listen']} ({how or 'no TLS: loopback or unix socket only'})")
    if config.forward is not None:
        from filechannel.agent.forward import check_forward

        for a in check_forward(config, [c["name"] for c in info["channels"]], config.forward):
            echo(f"would take the forward protocol on {a.scheme}://{a.host}:{a.port} into {a.channel}")
    for ch in info["channels"]:
        consumers = ", ".join(f"{n} (acked {c['acked']})" for n, c in sorted(ch["consumers"].items())) or "none"
        echo(
            f"channel {ch['channel']} {ch['directory']}: positions [{ch['start']}, {ch['end']}), consumers: {consumers}"
        )
    for kind, specs in (("syslog", args.syslog), ("relp", args.relp)):
        for spec in specs or ():
            echo(f"would take {kind} on {spec}")
    return 0


def _run(args: argparse.Namespace, config: AgentConfig, serve: Callable[..., Any]) -> int:
    """Serve until SIGTERM or SIGINT (or a tail source fails), the agent's log on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("filechannel serve: %(levelname)s: %(message)s"))
    pkg = logging.getLogger("filechannel")
    pkg.addHandler(handler)
    pkg.setLevel(log_level_of(args) or logging.INFO)
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


def serve_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
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


def keygen_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel keygen``."""
    sp.add_argument("keystore", metavar="KEYSTORE", help="keystore file (JSON: key id -> base64 key)")
    sp.add_argument("--id", metavar="ID", help="the new key's id (default: the UTC time, YYYY-MM-DD-HHMMSS)")


def serve_arguments(sp: argparse.ArgumentParser) -> None:
    """The options of ``filechannel serve``."""
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
    log_level_arg(sp, default="info; -v and -vv also apply")
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
    room_args(sp, "with --writable: ")
    sp.add_argument(
        "--cache-bytes",
        type=size_arg,
        metavar="SIZE",
        help="with --writable: memory per channel for recent puts that serve takes, e.g. 64M (default 16M; 0: none)",
    )
    sp.add_argument(
        "--insecure-allow-anyone",
        action="store_true",
        help="listen on an address other hosts reach without --client-ca or --token-file: anyone who can connect "
        "may then read, write and take over consumers (refused without this flag)",
    )
    _serve_source_arguments(sp)
    sp.add_argument(
        "--check",
        action="store_true",
        help="check everything a start checks, print what would be served and exit (a dry run: binds nothing, "
        "opens no channel as owner, changes nothing on disk; exit 2 with one line per problem)",
    )


def _serve_source_arguments(sp: argparse.ArgumentParser) -> None:
    """``serve``'s HTTP port and its sources: ``--http``, ``--tail``, ``--forward``, ``--syslog``, ``--relp``."""
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
