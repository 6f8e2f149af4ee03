"""Sources that feed a channel from this host with no agent and no network: today, tailing files.

A source here reads something local (files) and puts it into an open
:class:`~filechannel.FileChannel` through its public API, exactly once by
channel marks; it needs no optional dependency, so it runs in-process as
well as under ``filechannel serve --tail``. The agent's network sources
(HTTP, OTLP, forward, syslog and RELP) stay in :mod:`filechannel.agent`: they
are protocols on the agent's listeners and share its TLS, its bearer check
and its idempotency ring.

- :class:`~filechannel.sources.tail.TailSource`: follow log files matching
  globs, line by line, through rotation and truncation (``tail.py``).
"""
