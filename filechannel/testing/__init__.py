"""filechannel.testing: test kit for pipelines built on a channel (crashes, damage, delivery checks).

* :func:`assert_exactly_once`, :func:`assert_at_least_once`: compare produced
  and delivered items and fail with a short report (:mod:`.checks`);
* :func:`damage`: reproducible damage to a closed channel, to test an
  ``on_corruption`` choice (:mod:`.damage`);
* :class:`CrashableChannel`: a channel on the simulated file system
  (:mod:`.simfs`) that can be power-cut at any instant (:mod:`.crashable`);
* :func:`stream_test` and its actions: a StreamTest for PySpark queries that
  read a channel, with driver and producer crashes (:mod:`.stream`, the runner;
  :mod:`.steps`, the actions; :mod:`.processes`, the child processes);
* the pytest plugin (:mod:`.plugin`, loaded through the ``pytest11`` entry
  point): fixtures ``fc_channel_dir``, ``fc_channel``, ``fc_crashable_channel``;
* :class:`filechannel.testing.pki.PKI`: a throwaway CA and certificates as files,
  for mutual TLS between agents and clients in tests and soaks (needs
  ``cryptography``, so it is imported from its module, not from here).

Nothing here imports PySpark: :func:`stream_test` runs Spark in a subprocess.
"""

from .checks import DeliveryError, DeliveryReport, assert_at_least_once, assert_exactly_once
from .crashable import CrashableChannel
from .damage import Damage, DamageError, damage
from .stream import (
    AddData,
    CheckAnswer,
    CheckExactlyOnce,
    CrashAgent,
    CrashDriver,
    CrashProducer,
    ExpectFailure,
    ProcessAllAvailable,
    StartStream,
    StopStream,
    StreamTestError,
    stream_test,
)

__all__ = [
    "assert_exactly_once",
    "assert_at_least_once",
    "DeliveryError",
    "DeliveryReport",
    "damage",
    "Damage",
    "DamageError",
    "CrashableChannel",
    "stream_test",
    "StreamTestError",
    "AddData",
    "StartStream",
    "StopStream",
    "ProcessAllAvailable",
    "CrashAgent",
    "CrashDriver",
    "CrashProducer",
    "CheckAnswer",
    "CheckExactlyOnce",
    "ExpectFailure",
]
