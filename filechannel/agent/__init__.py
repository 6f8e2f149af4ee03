"""The filechannel agent: serve a host's channels over Arrow Flight, and read them from other hosts.

This package owns the network side of a channel (see ``docs/agents.md``):

- :func:`serve` starts an agent in this process (``filechannel serve`` runs one);
- :func:`connect` returns an :class:`AgentClient` (discovery, consumers,
  acknowledgements, verified reads); :class:`AgentSettings` is its picklable form.

Both need pyarrow (``pip install '.[agent]' in filechannel's clone``), imported only when
one of them is first used; the exceptions in :mod:`filechannel.agent.errors`
need nothing optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    AgentAuthError,
    AgentError,
    AgentProtocolError,
    AgentTimeoutError,
    AgentUnavailableError,
    UnknownChannelError,
)

if TYPE_CHECKING:
    from .client import AgentClient, AgentSettings, ChannelInfo, PutResult, RawSegment, connect
    from .server import Agent, AgentConfig, serve

__all__ = [
    "Agent",
    "AgentAuthError",
    "AgentClient",
    "AgentConfig",
    "AgentError",
    "AgentProtocolError",
    "AgentSettings",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "ChannelInfo",
    "PutResult",
    "RawSegment",
    "UnknownChannelError",
    "connect",
    "serve",
]

_LAZY = {
    "AgentClient": "client",
    "AgentSettings": "client",
    "ChannelInfo": "client",
    "PutResult": "client",
    "RawSegment": "client",
    "connect": "client",
    "Agent": "server",
    "AgentConfig": "server",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import pyarrow.flight  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"filechannel.agent.{name} needs pyarrow with Arrow Flight: pip install '.[agent]' in filechannel's clone"
        ) from exc
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
