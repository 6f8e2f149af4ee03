"""The ``filechannel`` Spark data source: what Spark instantiates, choosing the local or the agent transport.

This module owns the top of the Spark integration: :class:`FileChannelDataSource`
(``spark.dataSource.register``) hands out the readers of :mod:`.source` (channel
files on this host) or :mod:`.remote` (channels on other hosts, through their
agents), and the writers of :mod:`.sink`. Both transports import only downward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader

from filechannel.errors import ConfigError

from .remote import AgentStreamReader, snapshot_partitions
from .source import MULTI_SCHEMA, SCHEMA, FileChannelBatchReader, FileChannelStreamReader, SourceOptions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter
    from pyspark.sql.types import StructType

__all__ = ["FileChannelDataSource", "register"]


def register(spark: SparkSession) -> None:
    """Register the ``filechannel`` data source in ``spark`` (once per session).

    The Python workers must import ``filechannel`` and ``pyarrow``: run the
    session with ``PYSPARK_PYTHON`` pointing at the interpreter that has them.
    """
    spark.dataSource.register(FileChannelDataSource)


class FileChannelDataSource(DataSource):
    """The Spark data source registered as ``"filechannel"`` (see the module docstring for options)."""

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
        options = SourceOptions.parse(self.options, streaming=False)
        return FileChannelBatchReader(options, schema, snapshot_partitions if options.agents else None)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Return an exactly-once stream reader (with admission control and ``availableNow``)."""
        options = SourceOptions.parse(self.options, streaming=True)
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
