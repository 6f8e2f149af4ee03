"""The Spark sink's agent side: rows staged at, and committed by, the agent that owns the channel.

This module owns what ``.option("agent", URI)`` adds to :mod:`filechannel.spark.sink`:
the options (``agent``, ``channel``, ``tlsCa``, ``tlsCert``, ``tlsKey``,
``tokenFile``, ``agentTimeoutMs``, ``agentRetryMs``; file paths only), and
:class:`AgentSinkTarget`, which the writers use instead of a channel directory:

- on each executor, :meth:`AgentSinkTarget.stage` streams a task's rows to the
  agent (``DoPut`` op ``stage``); the agent makes one staged file durable per
  task attempt and names it in the answer, which the task's commit message carries;
- on the driver, :meth:`AgentSinkTarget.commit_batch` asks the agent to put the
  staged files of the committed task attempts in one channel transaction with
  the mark ``spark-sink:<query>`` = batch id (``filechannel.agent.staging``),
  retrying while the agent cannot be reached (for ``agentRetryMs``): the mark
  makes a repeated commit a no-op, so retries are safe; :meth:`abort` drops a
  batch's staged files.

Picklable (the options are a URI, file paths and numbers; the connection is
made again in each process). pyarrow is imported only when the agent is used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from filechannel.errors import ConfigError

if TYPE_CHECKING:
    from filechannel.agent.client import AgentClient, AgentSettings, ClientCache

__all__ = ["AGENT_OPTIONS", "AgentSinkOptions", "AgentSinkTarget"]

logger = logging.getLogger(__name__)

#: The sink's options (lower-cased) that belong to the agent.
AGENT_OPTIONS = ("agent", "channel", "tlsca", "tlscert", "tlskey", "tokenfile", "agenttimeoutms", "agentretryms")
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_RETRY_MS = 60_000


@dataclass(frozen=True)
class AgentSinkOptions:
    """How the sink reaches its agent, and which of the agent's channels it writes.

    Attributes:
        uri: The agent (``grpc+tls://HOST:PORT``, ``grpc://127.0.0.1:PORT``, ``grpc+unix:///PATH``).
        channel: The channel at the agent, by id (hex) or name (its directory's base name);
            None when the agent serves one channel.
        tls_ca, tls_cert, tls_key, token_file: File paths (never contents), as for the source.
        timeout: The deadline of each call, in seconds (``agentTimeoutMs``).
        retry: How long a commit keeps retrying an agent it cannot reach, in seconds (``agentRetryMs``).
    """

    uri: str
    channel: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT_MS / 1000
    retry: float = DEFAULT_RETRY_MS / 1000

    @classmethod
    def from_spark(cls, opts: Mapping[str, str]) -> AgentSinkOptions:
        """Parse the agent options of lower-cased Spark options (``agent`` given).

        Raises:
            ConfigError: A bad URI or number, or TLS files for a URI without TLS (named as the Spark option).
        """
        out = cls(
            uri=str(opts["agent"]).strip(),
            channel=(opts.get("channel") or None),
            tls_ca=opts.get("tlsca") or None,
            tls_cert=opts.get("tlscert") or None,
            tls_key=opts.get("tlskey") or None,
            token_file=opts.get("tokenfile") or None,
            timeout=_millis(opts, "agenttimeoutms", "agentTimeoutMs", DEFAULT_TIMEOUT_MS, positive=True),
            retry=_millis(opts, "agentretryms", "agentRetryMs", DEFAULT_RETRY_MS, positive=False),
        )
        names = {
            "uri": "agent",
            "tls_ca": "tlsCa",
            "tls_cert": "tlsCert",
            "tls_key": "tlsKey",
            "timeout": "agentTimeoutMs",
        }
        try:
            out.settings()
        except ConfigError as exc:
            raise ConfigError(names.get(exc.option, exc.option), exc.reason) from None
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ConfigError("agent", f"the sink through an agent needs pyarrow with Arrow Flight ({exc})") from None
        return out

    def settings(self) -> AgentSettings:
        """The picklable client settings (checks the URI and the TLS options)."""
        from filechannel.agent.client import AgentSettings

        return AgentSettings(
            self.uri,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            token_file=self.token_file,
            timeout=self.timeout,
        )


def _millis(opts: Mapping[str, Any], key: str, name: str, default: int, *, positive: bool) -> float:
    raw = opts.get(key)
    if raw is None:
        return default / 1000
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise ConfigError(name, f"must be an int number of milliseconds, got {raw!r}") from None
    if v < (1 if positive else 0):
        raise ConfigError(name, f"must be {'> 0' if positive else '>= 0'} milliseconds, got {raw!r}")
    return v / 1000


_CLIENTS: list[ClientCache] = []  # per process: one connection per agent (the cache made late, as pyarrow is)


def _client(settings: AgentSettings) -> AgentClient:
    if not _CLIENTS:
        from filechannel.agent.client import ClientCache

        _CLIENTS.append(ClientCache())
    return _CLIENTS[0].get(settings)


def _forget(settings: AgentSettings) -> None:
    if _CLIENTS:
        _CLIENTS[0].forget(settings)


class AgentSinkTarget:
    """The agent and channel a sink writes to (made on the driver, pickled to the executors).

    Args:
        options: The agent options.
        sleep: Waits between commit retries (tests shorten it).

    Raises:
        ConfigError: The ``channel`` option names no channel the agent serves, or it serves
            several and none is named.
        AgentUnavailableError, AgentAuthError: The agent cannot be reached or refuses the caller.
    """

    def __init__(self, options: AgentSinkOptions, sleep: Any = time.sleep) -> None:
        self.options = options
        self.settings = options.settings()
        self.sleep = sleep
        self.channel = self._resolve()

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "settings": self.settings, "channel": self.channel}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.sleep = time.sleep

    def _resolve(self) -> str:
        served = _client(self.settings).channels()
        want = self.options.channel
        if want is None:
            if len(served) == 1:
                return next(iter(served))
            names = ", ".join(f"{c.channel} ({c.name})" for c in served.values()) or "none"
            raise ConfigError(
                "channel", f"the agent {self.options.uri} serves {len(served)} channels ({names}): name one"
            )
        if want.lower() in served:
            return want.lower()
        named = [c.channel for c in served.values() if c.name == want]
        if len(named) == 1:
            return named[0]
        names = ", ".join(f"{c.channel} ({c.name})" for c in served.values()) or "none"
        why = "several channels have that name: give the id" if named else f"the agent serves {names}"
        raise ConfigError("channel", f"{want!r} is no channel of the agent {self.options.uri}: {why}")

    # -- executors ------------------------------------------------------------------------

    def stage(
        self,
        events: Iterable[tuple[bytes, Mapping[str, str] | None]],
        *,
        partition: int,
        attempt: int,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
    ) -> tuple[tuple[str, ...], int, int]:
        """Stage a task's rows at the agent (durable there on return): ``(files, rows, bytes)``.

        A failure fails the task (Spark runs it again, as another attempt, staging anew).
        """
        try:
            name, rows, size = _client(self.settings).sink_stage(
                self.channel, events, partition=partition, attempt=attempt, query=query, batch_id=batch_id, job=job
            )
        except Exception:
            _forget(self.settings)
            raise
        return ((name,) if name else ()), rows, size

    # -- the driver -----------------------------------------------------------------------

    def commit(
        self,
        files: Sequence[str],
        rows: int,
        *,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
        stale_staging: float | None = None,
    ) -> dict[str, Any]:
        """Commit staged files at the agent (exactly once per (query, batch id) or job id), retrying while unreachable.

        Raises:
            AgentUnavailableError: The agent stayed unreachable for ``agentRetryMs``; a restarted
                query commits the batch (its replay) again, at most once.
            ChannelError: The agent refused the batch (nothing of it was put).
        """
        from filechannel.agent.errors import AgentUnavailableError

        start = time.monotonic()
        delay = 0.2
        while True:
            try:
                return _client(self.settings).sink_commit(
                    self.channel,
                    list(files),
                    rows=rows,
                    query=query,
                    batch_id=batch_id,
                    job=job,
                    stale_staging=stale_staging,
                )
            except AgentUnavailableError as exc:
                _forget(self.settings)
                waited = time.monotonic() - start
                if waited >= self.options.retry:
                    raise
                logger.warning("commit at %s failed (%s); retrying in %.1f s", self.options.uri, exc, delay)
                self.sleep(min(delay, max(0.0, self.options.retry - waited)))
                delay = min(delay * 2, 2.0)

    def abort(
        self,
        files: Sequence[str],
        *,
        query: str | None = None,
        batch_id: int | None = None,
        job: str | None = None,
        stale_staging: float | None = None,
    ) -> int:
        """Drop staged files at the agent (best effort: what is left is swept after ``staleStagingSeconds``)."""
        from filechannel.errors import ChannelError

        try:
            return _client(self.settings).sink_abort(
                self.channel, list(files), query=query, batch_id=batch_id, job=job, stale_staging=stale_staging
            )
        except ChannelError as exc:
            _forget(self.settings)
            logger.warning("abort at %s failed (%s); stale staged files are swept later", self.options.uri, exc)
            return 0
