"""The agent's exceptions, re-exported from :mod:`filechannel.errors` (where the root lives).

They need nothing optional, so a caller can catch them without pyarrow.
Errors the channel itself raises at the agent (``DataLossError``,
``ConsumerIdentityError``, ``CorruptLogError``, ...) reach the client as those
same classes, with the agent's address in their message.
"""

from __future__ import annotations

from filechannel.errors import (
    AgentAuthError,
    AgentError,
    AgentProtocolError,
    AgentTimeoutError,
    AgentUnavailableError,
    UnknownChannelError,
)

__all__ = [
    "AgentAuthError",
    "AgentError",
    "AgentProtocolError",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "UnknownChannelError",
]
