"""Bringing a Flume FileChannel configuration over: its properties, mapped to filechannel's options.

This module owns the mapping table (docs/flume.md prints it) and a small reader
of Java ``.properties`` files. It opens nothing: :func:`options_from_properties`
returns keyword options for :func:`filechannel.open` (and the CLI's
``--flume-properties``), and says which Flume keys have no counterpart and why.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

logger = logging.getLogger(__name__)

_MAX_PROPERTIES = 1 << 20  # a properties file larger than this is not a Flume agent's configuration


def _int(v: str) -> int:
    return int(v.strip())


def _ms_to_s(v: str) -> float:
    return int(v.strip()) / 1000.0


def _bool(v: str) -> bool:
    s = v.strip().lower()
    if s not in ("true", "false"):
        raise ValueError(f"not true or false: {v!r}")
    return s == "true"


def _dirs(v: str) -> tuple[str, ...]:
    out = tuple(d.strip() for d in v.split(",") if d.strip())
    if not out:
        raise ValueError("an empty list of directories")
    return out


# Flume key -> (our option, converter). The order is the table's in docs/flume.md.
MAPPED: dict[str, tuple[str, Callable[[str], Any]]] = {
    "capacity": ("capacity", _int),
    "transactionCapacity": ("transaction_capacity", _int),
    "maxFileSize": ("max_file_size", _int),
    "minimumRequiredSpace": ("minimum_required_space", _int),
    "keep-alive": ("keep_alive", lambda v: float(v.strip())),
    "checkpointInterval": ("checkpoint_interval", _ms_to_s),  # milliseconds in Flume, seconds here
    "dataDirs": ("data_dirs", _dirs),
    "fsyncInterval": ("fsync_interval", lambda v: float(v.strip())),
}

# Flume keys with no option of their own here, and why (a WARNING names each one found).
IGNORED: dict[str, str] = {
    "type": "must be `file` (checked)",
    "checkpointDir": "checkpoints live in DIR/checkpoints, beside the data: give the channel directory instead",
    "use-log-replay-v1": "one replay here (merged by write-order id, as Flume's default)",
    "use-fast-replay": "a full replay here reads every live file without a checkpoint; nothing to choose",
    "compressBackupCheckpoint": "checkpoints are not compressed",
    "checkpointOnClose": "a checkpoint is always written on close",
}


@dataclass
class FlumeOptions:
    """What a Flume channel's properties become: ``options`` for :func:`filechannel.open`, and what was left out."""

    channel: str
    options: dict[str, Any] = field(default_factory=dict)
    ignored: list[tuple[str, str]] = field(default_factory=list)


def parse_properties(text: str) -> dict[str, str]:
    """Parse Java ``.properties`` text: ``key = value`` or ``key: value``, comments, continued lines.

    Comments start with ``#`` or ``!``; a line ending in a backslash continues on the next.

    Raises:
        ConfigError: A line with no key.
    """
    out: dict[str, str] = {}
    logical = ""
    for raw in text.splitlines():
        line = raw.lstrip()
        if not logical and (not line or line[0] in "#!"):
            continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            logical += line[:-1]
            continue
        logical += line
        m = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)$", logical)
        if m is None:
            if logical.strip():
                out[logical.strip()] = ""
        else:
            out[m.group(1)] = m.group(2).strip()
        logical = ""
    return out


def options_from_properties(
    source: str | os.PathLike[str] | Mapping[str, str], channel: str | None = None
) -> FlumeOptions:
    """Map a Flume FileChannel's configuration to filechannel options.

    ``source`` is a Flume agent's properties file (or its parsed mapping); ``channel``
    names the channel (``agent.channels.name``, or just ``name`` when one agent is
    configured). Without it the file must configure exactly one channel of type
    ``file``.

    Raises:
        ConfigError: The file is unreadable, names no such channel (or several file
            channels and no ``channel``), a value does not convert, or encryption is
            configured (Flume's JCEKS keystores are not read: make a keystore with
            ``filechannel keygen`` and pass ``encryption=``).
    """
    if isinstance(source, Mapping):
        props = dict(source)
        where = "the properties"
    else:
        where = os.fspath(source)
        try:
            with open(where, "rb") as f:
                data = f.read(_MAX_PROPERTIES + 1)
        except OSError as exc:
            raise ConfigError("flume_properties", f"cannot read {where}: {exc.strerror or exc}") from exc
        if len(data) > _MAX_PROPERTIES:
            raise ConfigError("flume_properties", f"{where} is larger than {_MAX_PROPERTIES} bytes")
        props = parse_properties(data.decode("latin-1"))  # the .properties encoding
    prefix = _channel_prefix(props, channel, where)
    out = FlumeOptions(prefix.rstrip("."))
    own = {k[len(prefix) :]: v for k, v in props.items() if k.startswith(prefix)}
    if own.get("type", "").lower() != "file":
        raise ConfigError("flume_properties", f"{out.channel} in {where} is of type {own.get('type')!r}, not 'file'")
    for key, value in sorted(own.items()):
        if key in MAPPED:
            name, conv = MAPPED[key]
            try:
                out.options[name] = conv(value)
            except ValueError as exc:
                raise ConfigError("flume_properties", f"{out.channel}.{key} = {value!r} in {where}: {exc}") from exc
        elif key == "fsyncPerTransaction":
            if not _bool(value):
                # Flume then skips corrupt records at replay and take and syncs on an interval.
                out.options.update(fsync="interval", on_corruption="skip")
        elif key in ("useDualCheckpoints", "backupCheckpointDir"):
            continue  # below, together
        elif key.startswith("encryption."):
            raise ConfigError(
                "flume_properties",
                f"{out.channel}.{key} in {where}: Flume's JCEKS keystores are not read; make a keystore with "
                "`filechannel keygen` and pass encryption= (or --keystore), see docs/encryption.md",
            )
        elif key in IGNORED:
            if key != "type":
                out.ignored.append((key, IGNORED[key]))
        else:
            out.ignored.append((key, "not a FileChannel property filechannel knows"))
    if own.get("useDualCheckpoints", "false").strip().lower() == "true":
        backup = own.get("backupCheckpointDir", "").strip()
        if not backup:
            raise ConfigError("flume_properties", f"{out.channel}.useDualCheckpoints needs backupCheckpointDir")
        out.options["backup_checkpoint_dir"] = backup
    for key, why in out.ignored:
        logger.warning("Flume property %s.%s is not carried over: %s", out.channel, key, why)
    return out


def _channel_prefix(props: Mapping[str, str], channel: str | None, where: str) -> str:
    """The ``agent.channels.name.`` prefix of the channel to map."""
    file_channels = sorted(
        k[: -len(".type")]
        for k, v in props.items()
        if k.endswith(".type") and ".channels." in k and v.lower() == "file"
    )
    if channel is not None:
        matches = [c for c in file_channels if c == channel or c.endswith(f".channels.{channel}")]
        if len(matches) != 1:
            found = ", ".join(file_channels) or "none"
            raise ConfigError(
                "flume_properties", f"{where} configures no single file channel {channel!r} (file channels: {found})"
            )
        return matches[0] + "."
    if len(file_channels) != 1:
        found = ", ".join(file_channels) or "none"
        raise ConfigError(
            "flume_properties", f"{where} configures {len(file_channels)} file channels ({found}): name one"
        )
    return file_channels[0] + "."
