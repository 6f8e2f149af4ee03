"""The agent's own exceptions (a client's view of an agent that cannot answer, or refuses).

They derive from the project's root, :class:`filechannel.ChannelError`, and
belong in ``filechannel/errors.py`` once the agent lands there; this module
imports nothing optional, so a caller can catch them without pyarrow.
Errors the channel itself raises at the agent (``DataLossError``,
``ConsumerIdentityError``, ``CorruptLogError``, ...) reach the client as those
same classes, with the agent's address in their message.
"""

from __future__ import annotations

from filechannel.errors import ChannelError

__all__ = [
    "AgentAuthError",
    "AgentError",
    "AgentProtocolError",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "UnknownChannelError",
]


class AgentError(ChannelError):
    """Root of the errors an agent call raises beyond the channel's own (``.uri`` names the agent)."""

    def __init__(self, uri: str, reason: str) -> None:
        self.uri = uri
        self.reason = reason
        super().__init__(f"agent {uri}: {reason}")


class AgentUnavailableError(AgentError):
    """The agent cannot be reached: stopped, not listening, the network, or a TLS handshake that failed."""


class AgentTimeoutError(AgentUnavailableError):
    """The agent did not answer within the call's deadline (``timeout``)."""


class AgentAuthError(AgentError):
    """The agent refused the caller: a missing or wrong bearer token, or a certificate name not allowed."""


class UnknownChannelError(AgentError):
    """The agent serves no channel with this id (``.channel``)."""

    def __init__(self, uri: str, channel: str, served: list[str]) -> None:
        self.channel = channel
        self.served = list(served)
        listed = ", ".join(self.served) or "none"
        super().__init__(uri, f"serves no channel with id {channel} (it serves: {listed})")


class AgentProtocolError(AgentError):
    """A request or an answer that does not follow the agent's wire format (another version?)."""
