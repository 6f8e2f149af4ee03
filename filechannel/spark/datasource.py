"""The ``filechannel`` Spark data source: what Spark instantiates, choosing the local or the agent transport.

This module owns the top of the Spark integration: :class:`FileChannelDataSource`
(``spark.dataSource.register``) hands out the readers of :mod:`.source` (channel
files on this host) or :mod:`.remote` (channels on other hosts, through their
agents), and the writers of :mod:`.sink`. Both transports import only downward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader

from filechannel.errors import ConfigError

from .remote import AgentStreamReader, snapshot_partitions
from .source import MULTI_SCHEMA, SCHEMA, FileChannelBatchReader, FileChannelStreamReader, SourceOptions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter
    from pyspark.sql.types import StructType

__all__ = ["FileChannelDataSource", "register", "with_parallelism"]

logger = logging.getLogger(__name__)


def register(spark: SparkSession) -> None:
    """Register the ``filechannel`` data source in ``spark`` (once per session).

    The Python workers must import ``filechannel`` and ``pyarrow``: run the
    session with ``PYSPARK_PYTHON`` pointing at the interpreter that has them.

    The session's ``defaultParallelism`` (its cores) is the source's default
    ``minPartitions``: a Python data source runs in worker processes that cannot
    ask the session, so the registered class carries it (registering
    :class:`FileChannelDataSource` itself gives the fixed default, 2).
    """
    spark.dataSource.register(with_parallelism(_default_parallelism(spark)))


def _default_parallelism(spark: SparkSession) -> int | None:
    """The session's ``defaultParallelism``, or ``None`` where there is none to ask (Spark Connect)."""
    try:
        n = int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001  (Spark Connect has no SparkContext; any failure means "unknown")
        logger.debug("filechannel: no defaultParallelism from this session; minPartitions defaults to 2")
        return None
    return n if n > 0 else None


def with_parallelism(n: int | None) -> type[FileChannelDataSource]:
    """:class:`FileChannelDataSource` whose default ``minPartitions`` is ``n`` (itself for ``None``).

    The subclass is made here, not importable by name, so Spark's cloudpickle
    sends it to the Python workers by value, ``n`` included.
    """
    if n is None:
        return FileChannelDataSource
    attrs = {"default_parallelism": n, "__module__": __name__, "__doc__": FileChannelDataSource.__doc__}
    return type("FileChannelDataSource", (FileChannelDataSource,), attrs)


class FileChannelDataSource(DataSource):
    """The Spark data source registered as ``"filechannel"`` (see the module docstring for options)."""

    #: The default ``minPartitions`` of the readers (set by :func:`with_parallelism`; ``None``: 2).
    default_parallelism: ClassVar[int | None] = None

    @classmethod
    def name(cls) -> str:
        """Return the short name used in ``format("filechannel")``."""
        return "filechannel"

    def schema(self) -> str:
        """Return ``position long, body binary, headers map<string,string>`` (+ ``channel string``)."""
        try:
            multi = SourceOptions.parse(self.options, streaming=False).multi
        except ConfigError:
            multi = False  # reported by reader() or streamReader(), which Spark calls next
        return MULTI_SCHEMA if multi else SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        """Return a batch reader: the committed, untaken events at the moment of planning."""
        options = SourceOptions.parse(self.options, streaming=False, default_partitions=self.default_parallelism)
        return FileChannelBatchReader(options, schema, snapshot_partitions if options.agents else None)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Return an exactly-once stream reader (with admission control and ``availableNow``)."""
        options = SourceOptions.parse(self.options, streaming=True, default_partitions=self.default_parallelism)
        if options.agents:
            return AgentStreamReader(options, schema)
        return FileChannelStreamReader(options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """Return the batch sink (``df.write.format("filechannel")``): see :mod:`filechannel.spark.sink`."""
        from .sink import FileChannelBatchWriter

        return FileChannelBatchWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        """Return the streaming sink (``writeStream.format("filechannel")``): see :mod:`filechannel.spark.sink`."""
        from .sink import FileChannelStreamWriter

        return FileChannelStreamWriter(self.options, schema)
