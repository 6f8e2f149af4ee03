"""filechannel.spark: read channels from Apache Spark (and write them) through the Python Data Source API.

Import it explicitly; ``import filechannel`` never imports PySpark, and ``filechannel.spark``
imports it only when its data source is first used (``register``)::

    import filechannel.spark
    filechannel.spark.register(spark)          # once per SparkSession
    df = (spark.readStream.format("filechannel")
          .option("consumer", "orders-to-parquet")
          .load("/var/lib/myapp/channel"))

Needs ``pip install '.[spark]' in filechannel's clone`` (PySpark 4.2+ and pyarrow) in the
driver and in the Python workers (``PYSPARK_PYTHON``), and Java 17+.
The source and its options are described in :mod:`filechannel.spark.source`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "register",
    "FileChannelDataSource",
    "FileChannelBatchReader",
    "FileChannelStreamReader",
    "CheckpointMismatchError",
    "SCHEMA",
]


def __getattr__(name: str) -> Any:
    """Import the data source (and so PySpark and pyarrow) when one of its names is first used.

    ``filechannel.spark.sink``'s staging and commit protocol need neither, so the
    package itself imports without them.
    """
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import pyarrow  # noqa: F401  (every Python data source needs it in the workers)
        import pyspark  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            f"filechannel.spark needs PySpark 4.2+ and pyarrow ({exc}): pip install '.[spark]' in filechannel's clone"
        ) from exc
    from . import datasource, source

    return getattr(datasource if name in ("register", "FileChannelDataSource") else source, name)
