"""The Spark sink's options: what ``.option(...)`` may say, parsed and checked once.

This module owns :class:`SinkOptions`, read from Spark's case-insensitive,
string-valued options: the channel directory, the ``channel.<name>`` options
(converted to their types and checked by :class:`~filechannel.ChannelConfig`),
the commit's ``lockTimeout``, the sweep of stale staged files, the keystore,
and the sink through an agent (``agent`` and its options, from
:mod:`filechannel.spark.agent_sink`), with the paths derived from them. It
reads and writes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from filechannel.config import ChannelConfig
from filechannel.crypto import Encryption
from filechannel.errors import (
    ConfigError,
)
from filechannel.staged import (  # the staged-file format, shared with the agent
    DEFAULT_STALE_STAGING,
    SINK_DIR,
    STAGING_DIR,
)

from .agent_sink import AGENT_OPTIONS, AgentSinkOptions

__all__ = ["DEFAULT_LOCK_TIMEOUT", "QUERIES_DIR", "SinkOptions"]

QUERIES_DIR = "queries"

DEFAULT_LOCK_TIMEOUT = 30.0
_SINK_OPTIONS = ("path", "checkpointlocation", "locktimeout", "stalestagingseconds", "keystore")
_CHANNEL_PREFIX = "channel."


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options, parsed from Spark's (case-insensitive, string-valued) options.

    Attributes:
        path: The channel directory (option ``path``, or ``save(path)`` / ``start(path)``).
        channel: Channel options from ``channel.<name>`` options, converted to
            their types and validated by :class:`~filechannel.ChannelConfig`.
        lock_timeout: Seconds a commit retries while another process holds the channel.
        stale_staging: Seconds after which a staged file nobody committed is swept.
        checkpoint_location: The query's ``checkpointLocation`` option, if given (used
            only when a task could not tell the query id).
        keystore: The ``keystore`` option: the path of the keystore of an encrypted
            channel (never key bytes: the path is what travels to executors). Its
            last key encrypts new data files and the staged rows.
        agent: With ``.option("agent", URI)``: rows are staged at, and committed by, the
            agent that owns the channel (:mod:`filechannel.spark.agent_sink`); ``path``
            is then empty.
    """

    path: str
    channel: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    stale_staging: float = DEFAULT_STALE_STAGING
    checkpoint_location: str | None = None
    keystore: str | None = None
    agent: AgentSinkOptions | None = None

    @classmethod
    def from_spark(cls, options: Mapping[str, str]) -> SinkOptions:
        """Parse and validate Spark options.

        Raises:
            ConfigError: ``path`` is missing, an option is unknown, or a value is invalid
                (``.option`` names the Spark option, e.g. ``channel.capacity``).
        """
        opts = {str(k).lower(): v for k, v in options.items()}
        if "agent" in opts:
            return cls._through_agent(opts)
        channel: dict[str, Any] = {}
        for key, value in opts.items():
            if key.startswith(_CHANNEL_PREFIX):
                channel[key[len(_CHANNEL_PREFIX) :]] = value
            elif key in AGENT_OPTIONS:
                raise ConfigError(key, "is an option of the sink through an agent: give .option('agent', URI) too")
            elif key not in _SINK_OPTIONS:
                raise ConfigError(
                    key,
                    "unknown option of the filechannel sink (known: path, checkpointLocation, lockTimeout, "
                    "staleStagingSeconds, keystore, and channel.<name> for any channel option such as "
                    "channel.capacity)",
                )
        path = opts.get("path")
        if not path:
            raise ConfigError("path", "the filechannel sink needs the channel directory: .option('path', DIR)")
        if "encryption" in channel:
            raise ConfigError("channel.encryption", "give the keystore path with .option('keystore', PATH)")
        converted = _channel_options(channel)
        keystore = opts.get("keystore") or None
        if keystore is not None:
            keystore = os.path.abspath(str(keystore))
            Encryption(keys=keystore)  # fail at once on a missing, exposed or malformed keystore
        return cls(
            path=os.path.abspath(str(path)),
            channel=converted,
            lock_timeout=_seconds(opts, "locktimeout", "lockTimeout", DEFAULT_LOCK_TIMEOUT),
            stale_staging=_seconds(opts, "stalestagingseconds", "staleStagingSeconds", DEFAULT_STALE_STAGING),
            checkpoint_location=opts.get("checkpointlocation") or None,
            keystore=keystore,
        )

    @classmethod
    def _through_agent(cls, opts: Mapping[str, Any]) -> SinkOptions:
        """The options of the sink through an agent (the agent owns the channel and its options)."""
        for key in opts:
            if key.startswith(_CHANNEL_PREFIX) or key in ("path", "keystore", "locktimeout"):
                why = {
                    "path": "the agent's channel is named with .option('channel', ID or NAME), not a path",
                    "keystore": "the agent encrypts with its own --keystore (staged rows too)",
                    "locktimeout": "the agent owns the channel: there is no lock to wait for",
                }.get(key, "the agent's channel options are set where it runs: filechannel serve --capacity ...")
                raise ConfigError(key, f"not an option of the sink through an agent: {why}")
            if key not in AGENT_OPTIONS and key not in ("checkpointlocation", "stalestagingseconds"):
                raise ConfigError(
                    key,
                    "unknown option of the filechannel sink through an agent (known: agent, channel, tlsCa, tlsCert, "
                    "tlsKey, tokenFile, agentTimeoutMs, agentRetryMs, agentFullWaitMs, staleStagingSeconds, "
                    "checkpointLocation)",
                )
        if not str(opts["agent"]).strip():
            raise ConfigError("agent", "give the agent's URI, e.g. grpc+tls://host:8815")
        return cls(
            path="",
            stale_staging=_seconds(opts, "stalestagingseconds", "staleStagingSeconds", DEFAULT_STALE_STAGING),
            checkpoint_location=opts.get("checkpointlocation") or None,
            agent=AgentSinkOptions.from_spark(opts),
        )

    def encryption(self) -> Encryption | None:
        """The keystore, loaded (each call reads it: a rotation needs no restart of the query), or None."""
        return None if self.keystore is None else Encryption(keys=self.keystore)

    def config(self) -> ChannelConfig:
        """Return the channel configuration these options give (see :func:`_config`)."""
        return _config(self.channel)

    @property
    def sink_dir(self) -> str:
        """``DIR/spark-sink``."""
        return os.path.join(self.path, SINK_DIR)

    @property
    def staging_dir(self) -> str:
        """``DIR/spark-sink/staging``: one file per successful task attempt until its batch commits."""
        return os.path.join(self.path, SINK_DIR, STAGING_DIR)

    @property
    def queries_dir(self) -> str:
        """``DIR/spark-sink/queries``: one state file per streaming query."""
        return os.path.join(self.path, SINK_DIR, QUERIES_DIR)


def _seconds(opts: Mapping[str, Any], key: str, name: str, default: float) -> float:
    raw = opts.get(key)
    if raw is None:
        return default
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a number of seconds, got {raw!r}") from None
    if not v >= 0 or v == float("inf"):
        raise ConfigError(name, f"must be a finite number of seconds >= 0, got {raw!r}")
    return v


def _config(channel: Mapping[str, Any]) -> ChannelConfig:
    """The channel configuration of ``channel.<name>`` options.

    ``transaction_capacity`` defaults to ``capacity`` here: the sink's own open
    raises it to ``capacity`` anyway (a batch is one transaction), so a small
    ``channel.capacity`` alone is valid.
    """
    opts = dict(channel)
    if "transaction_capacity" not in opts:
        opts["transaction_capacity"] = min(
            ChannelConfig.transaction_capacity, opts.get("capacity", ChannelConfig.capacity)
        )
    return ChannelConfig.from_options(opts)


def _channel_options(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Convert ``channel.<name>`` string values to the types ChannelConfig expects, and validate them."""
    known = {f.name: f for f in dataclasses.fields(ChannelConfig)}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        f = known.get(name)
        if f is None:
            raise ConfigError(_CHANNEL_PREFIX + name, f"unknown channel option (known: {', '.join(sorted(known))})")
        if not isinstance(value, str):
            out[name] = value
            continue
        text = value.strip()
        default = f.default
        try:
            if name == "data_dirs":
                out[name] = tuple(p.strip() for p in text.split(",") if p.strip())
            elif name == "max_event_size" or (isinstance(default, int) and not isinstance(default, bool)):
                out[name] = int(text)
            elif isinstance(default, float):
                out[name] = float(text)
            else:
                out[name] = text
        except ValueError:
            kind = "a float" if isinstance(default, float) else "an int"
            raise ConfigError(_CHANNEL_PREFIX + name, f"must be {kind}, got {value!r}") from None
    try:
        _config(out)
    except ConfigError as exc:
        raise ConfigError(_CHANNEL_PREFIX + exc.option, exc.reason) from exc
    return out
