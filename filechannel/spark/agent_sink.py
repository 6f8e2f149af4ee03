"""The Spark sink's agent side: rows staged at, and committed by, the agent that owns the channel.

This module owns what ``.option("agent", URI)`` adds to :mod:`filechannel.spark.sink`:
the options (``agent``, ``channel``, ``tlsCa``, ``tlsCert``, ``tlsKey``,
``tokenFile``, ``agentTimeoutMs``, ``agentRetryMs``, ``agentFullWaitMs``; file
paths only), and :class:`AgentSinkTarget`, which the writers use instead of a
channel directory:

- on each executor, :meth:`AgentSinkTarget.stage` streams a task's rows to the
  agent (``DoPut`` op ``stage``); the agent makes one staged file durable per
  task attempt and names it in the answer, which the task's commit message carries;
- on the driver, :meth:`AgentSinkTarget.commit_batch` asks the agent to put the
  staged files of the committed task attempts in one channel transaction with
  the mark ``spark-sink:<query>`` = batch id (``filechannel.agent.staging``),
  retrying while the agent cannot be reached (for ``agentRetryMs``): the mark
  makes a repeated commit a no-op, so retries are safe; :meth:`abort` drops a
  batch's staged files;
- **a full channel is back-pressure**: when the agent answers with its full
  error (``ChannelFullError``: the channel's capacity, its free-space floor, a
  write undone after ENOSPC), nothing of the stage or the commit was kept, so
  both wait and try again (backing off to 2 s) for ``agentFullWaitMs``, while
  consumers drain the channel. A task sends its rows again from memory: it
  keeps the rows it sent, up to :data:`REPLAY_BYTES` (a larger task refused
  after that many fails, and Spark runs it again). After ``agentFullWaitMs``
  the error says what to do; a restarted query commits the batch, once.

Picklable (the options are a URI, file paths and numbers; the connection is
made again in each process). pyarrow is imported only when the agent is used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from filechannel.errors import ConfigError

if TYPE_CHECKING:
    from filechannel.agent.client import AgentClient, AgentSettings, ClientCache
    from filechannel.errors import ChannelFullError

__all__ = ["AGENT_OPTIONS", "AgentSinkOptions", "AgentSinkTarget"]

logger = logging.getLogger(__name__)

#: The sink's options (lower-cased) that belong to the agent.
AGENT_OPTIONS = (
    "agent",
    "channel",
    "tlsca",
    "tlscert",
    "tlskey",
    "tokenfile",
    "agenttimeoutms",
    "agentretryms",
    "agentfullwaitms",
)
DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_RETRY_MS = 60_000
DEFAULT_FULL_WAIT_MS = 600_000
REPLAY_BYTES = 16 << 20
"""Bytes of rows a task keeps while it stages, so that it can send them again if the agent's channel is full."""


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
        full_wait: How long a stage or a commit keeps trying while the agent's channel is full,
            in seconds (``agentFullWaitMs``; 0: fail at the first refusal).
    """

    uri: str
    channel: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT_MS / 1000
    retry: float = DEFAULT_RETRY_MS / 1000
    full_wait: float = DEFAULT_FULL_WAIT_MS / 1000

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
            full_wait=_millis(opts, "agentfullwaitms", "agentFullWaitMs", DEFAULT_FULL_WAIT_MS, positive=False),
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

        While the agent's channel is full the rows are sent again (from memory) when
        there is room, for up to ``agentFullWaitMs``. Any other failure fails the task
        (Spark runs it again, as another attempt, staging anew).

        Raises:
            ChannelFullError: The channel stayed full for ``agentFullWaitMs``, or refused the
                task after more than :data:`REPLAY_BYTES` of its rows were sent.
        """
        from filechannel.errors import ChannelFullError

        what = f"partition {partition} of " + (f"batch job {job}" if job is not None else f"batch {batch_id}")
        rows = _Replay(events, REPLAY_BYTES)
        waiting = _FullWait(self, what)
        while True:
            try:
                name, n, size = _client(self.settings).sink_stage(
                    self.channel, rows, partition=partition, attempt=attempt, query=query, batch_id=batch_id, job=job
                )
            except ChannelFullError as exc:
                if rows.lost:
                    raise ChannelFullError(
                        f"{what}: the agent's channel is full ({exc}), and more than {REPLAY_BYTES} bytes of the "
                        "task's rows were sent before it said so: the task cannot send them again itself, so it "
                        "fails and Spark runs it again; drain the channel (consumers take or acknowledge events) or "
                        "make the tasks smaller",
                        exc.reason,
                    ) from None
                waiting.wait(exc, "stage")
            except Exception:
                _forget(self.settings)
                raise
            else:
                return ((name,) if name else ()), n, size

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
        """Commit staged files at the agent (exactly once per (query, batch id) or job id).

        Retries while the agent cannot be reached (for ``agentRetryMs``) and while its
        channel is full (for ``agentFullWaitMs``): the agent put nothing of the batch
        then, and a repeated commit of a batch that did land is a no-op.

        Raises:
            AgentUnavailableError: The agent stayed unreachable for ``agentRetryMs``; a restarted
                query commits the batch (its replay) again, at most once.
            ChannelFullError: The channel stayed full for ``agentFullWaitMs`` (nothing of the batch
                was put; the message says what to do).
            ChannelError: The agent refused the batch (nothing of it was put).
        """
        from filechannel.agent.errors import AgentUnavailableError
        from filechannel.errors import ChannelFullError

        what = f"batch job {job}" if job is not None else f"batch {batch_id} of query {query}"
        start = time.monotonic()
        delay = 0.2
        waiting = _FullWait(self, what)
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
            except ChannelFullError as exc:
                waiting.wait(exc, "commit")
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


class _FullWait:
    """How a stage or a commit waits while the agent's channel is full: back off to 2 s, for ``agentFullWaitMs``."""

    def __init__(self, target: AgentSinkTarget, what: str) -> None:
        self.target = target
        self.what = what
        self.start = time.monotonic()
        self.delay = 0.2
        self.refusals = 0

    def wait(self, exc: ChannelFullError, step: str) -> None:
        """Sleep before the next try, or raise the final error when ``agentFullWaitMs`` is spent.

        Raises:
            ChannelFullError: The channel stayed full for ``agentFullWaitMs``: what to do, in words.
        """
        from filechannel.errors import ChannelFullError

        limit = self.target.options.full_wait
        waited = time.monotonic() - self.start
        self.refusals += 1
        if waited >= limit:
            raise ChannelFullError(
                f"{self.what}: the agent's channel stayed full for {waited:.0f} s (agentFullWaitMs="
                f"{limit * 1000:.0f}): {exc}. Nothing of it was kept. Have the channel's consumers take or "
                "acknowledge events (so data files retire), free disk space at the agent, or raise its --capacity "
                "or --max-bytes; then restart the query (it commits the batch once) or run the job again",
                exc.reason,
            ) from None
        if self.refusals == 1 or (self.delay >= 2.0 and self.refusals % 15 == 0):
            logger.warning(
                "%s: the channel at %s is full (%s); the %s waits for room (up to agentFullWaitMs=%.0f ms)",
                self.what,
                self.target.options.uri,
                exc,
                step,
                limit * 1000,
            )
        self.target.sleep(min(self.delay, max(0.0, limit - waited)))
        self.delay = min(self.delay * 2, 2.0)


class _Replay:
    """A task's rows, kept as they are sent (up to ``limit`` bytes) so that they can be sent again.

    Each iteration yields the rows kept so far, then goes on with the rows not yet read.
    ``lost``: more than ``limit`` bytes were read, so the rows kept are not all of them.
    """

    def __init__(self, events: Iterable[tuple[bytes, Mapping[str, str] | None]], limit: int) -> None:
        self._rest: Iterator[tuple[bytes, Mapping[str, str] | None]] = iter(events)
        self._kept: list[tuple[bytes, Mapping[str, str] | None]] = []
        self._bytes = 0
        self._limit = limit
        self.lost = False

    def __iter__(self) -> Iterator[tuple[bytes, Mapping[str, str] | None]]:
        if self.lost:
            raise RuntimeError("the rows sent are no longer all kept")
        for i in range(len(self._kept)):  # the rows kept before this pass (this pass may add more)
            yield self._kept[i]
        for row in self._rest:
            if not self.lost:
                body, headers = row
                self._bytes += len(body) + (sum(len(k) + len(v) for k, v in headers.items()) if headers else 0)
                if self._bytes > self._limit:
                    self.lost = True
                    self._kept = []
                else:
                    self._kept.append(row)
            yield row
