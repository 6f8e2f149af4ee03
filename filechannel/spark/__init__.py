"""filechannel.spark: read channels from Apache Spark (and write them) through the Python Data Source API.

Import it explicitly; ``import filechannel`` never imports PySpark::

    import filechannel.spark
    filechannel.spark.register(spark)          # once per SparkSession
    df = (spark.readStream.format("filechannel")
          .option("consumer", "orders-to-parquet")
          .load("/var/lib/myapp/channel"))

Needs ``pip install 'filechannel[spark]'`` (PySpark 4.2+ and pyarrow) in the
driver and in the Python workers (``PYSPARK_PYTHON``), and Java 17+.
The source and its options are described in :mod:`filechannel.spark.source`.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401  (every Python data source needs it in the workers)
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"filechannel.spark needs PySpark 4.2+ and pyarrow ({exc}): pip install 'filechannel[spark]'"
    ) from exc

from .source import (
    SCHEMA,
    CheckpointMismatchError,
    FileChannelBatchReader,
    FileChannelDataSource,
    FileChannelStreamReader,
    register,
)

__all__ = [
    "register",
    "FileChannelDataSource",
    "FileChannelBatchReader",
    "FileChannelStreamReader",
    "CheckpointMismatchError",
    "SCHEMA",
]
