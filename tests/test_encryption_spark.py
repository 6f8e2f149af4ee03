"""Encryption through the Spark source and sink: a keystore path option, no plaintext staged, no key in a plan.

The sink tests drive the writers without a JVM (as tests/test_spark_sink_writers.py
does); the ``spark`` ones run a batch read and a batch write on the shared
local session.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from test_encryption import K1, K2, assert_no_plaintext, write_keystore  # noqa: E402
from test_spark_sink_writers import CH_OPTS, QUERY, SCHEMA, batch_of, fake_task, run_writer  # noqa: E402, F401

import filechannel  # noqa: E402
from filechannel import ChannelReader, Encryption  # noqa: E402
from filechannel._fs import DEFAULT_FS  # noqa: E402
from filechannel.spark.sink import FileChannelStreamWriter, SinkOptions, read_staged  # noqa: E402
from filechannel.spark.source import SourceOptions  # noqa: E402


def events(d: Path, ks: str) -> list[filechannel.Event]:
    with ChannelReader(str(d), encryption=ks) as v:
        start, end = v.available()
        return v.read(start, end)


def test_sink_stages_sealed_rows_and_commits_encrypted(tmp_path: Path, fake_task: dict[str, Any]) -> None:  # noqa: F811
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d = tmp_path / "ch"
    opts = {"path": str(d), **CH_OPTS, "keystore": ks}
    w = FileChannelStreamWriter(opts, SCHEMA)
    msgs = run_writer(w, fake_task, 0, [[batch_of([b"SINK-SECRET-a", b"SINK-SECRET-b"], [{"h": "SINK-HDR"}, None])]])
    staged = os.path.join(w.options.staging_dir, msgs[0].files[0])
    raw = Path(staged).read_bytes()
    assert b"SINK-SECRET" not in raw
    assert b"SINK-HDR" not in raw
    assert raw.startswith(b"FCSTAGE4")  # columns, each chunk sealed
    with pytest.raises(filechannel.DecryptionError, match="keystore"):
        read_staged(DEFAULT_FS, staged)
    assert len(read_staged(DEFAULT_FS, staged, Encryption(keys=ks))) == 2
    # A flipped ciphertext bit, the file's checksum fixed up: refused, never returned.
    bad = bytearray(raw)
    bad[-20] ^= 1  # inside the last chunk's ciphertext (before the 12-byte trailer)
    struct.pack_into("<I", bad, len(bad) - 4, zlib.crc32(bytes(bad[:-4])))
    Path(staged).write_bytes(bytes(bad))
    with pytest.raises(filechannel.DecryptionError, match="staged chunk 0"):
        read_staged(DEFAULT_FS, staged, Encryption(keys=ks))
    # The intact file under another name does not decrypt either (its name is in its key).
    copy = os.path.join(w.options.staging_dir, "copy-" + msgs[0].files[0])
    Path(copy).write_bytes(raw)
    with pytest.raises(filechannel.DecryptionError, match="staged chunk 0"):
        read_staged(DEFAULT_FS, copy, Encryption(keys=ks))
    os.unlink(copy)
    Path(staged).write_bytes(raw)
    FileChannelStreamWriter(opts, SCHEMA).commit(list(msgs), 0)
    got = events(d, ks)
    assert [e.body for e in got] == [b"SINK-SECRET-a", b"SINK-SECRET-b"]
    assert got[0].headers["h"] == "SINK-HDR"
    assert_no_plaintext(str(d), [b"SINK-SECRET", b"SINK-HDR"])
    with pytest.raises(filechannel.DecryptionError):
        ChannelReader(str(d)).available()


def test_options_carry_the_keystore_path_never_key_bytes(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1, "k2": K2})
    d = str(tmp_path / "ch")
    so = SinkOptions.from_spark({"path": d, "keystore": ks})
    src = SourceOptions.parse({"path": d, "keystore": ks, "consumer": "c"}, streaming=True)
    for o in (so, src):
        blob = pickle.dumps(o)
        assert K1 not in blob
        assert K2 not in blob
        assert ks.encode() in blob
    loose = write_keystore(tmp_path / "loose.json", {"k1": K1}, mode=0o644)
    with pytest.raises(filechannel.ConfigError, match="chmod 600"):
        SinkOptions.from_spark({"path": d, "keystore": loose})
    with pytest.raises(filechannel.ConfigError, match="chmod 600"):
        SourceOptions.parse({"path": d, "keystore": loose}, streaming=False)
    with pytest.raises(filechannel.ConfigError, match="keystore"):
        SinkOptions.from_spark({"path": d, "channel.encryption": "x"})


@pytest.mark.spark
def test_spark_reads_and_writes_an_encrypted_channel(spark: Any, tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    src = tmp_path / "src"
    ch = filechannel.open(str(src), encryption=Encryption(keys=ks), minimum_required_space=0)
    with ch.transaction() as tx:
        for i in range(50):
            tx.put(b"SPARK-SECRET-%02d" % i, headers={"i": str(i)})
    ch.close()
    df = spark.read.format("filechannel").option("keystore", ks).option("maxPartitionBytes", "1024").load(str(src))
    rows = sorted(df.collect(), key=lambda r: r.position)
    assert [bytes(r.body) for r in rows] == [b"SPARK-SECRET-%02d" % i for i in range(50)]
    # The query plan shows the keystore path, never a key.
    plan = df._jdf.queryExecution().toString()
    assert K1.hex() not in plan
    with pytest.raises(Exception, match="encrypt"):
        spark.read.format("filechannel").load(str(src)).collect()
    # Write them into another encrypted channel through the sink.
    dest = tmp_path / "dest"
    w = df.select("body", "headers").write.format("filechannel").mode("append").option("keystore", ks)
    for k, v in CH_OPTS.items():
        w = w.option(k, v)
    w.save(str(dest))
    got = events(dest, ks)
    assert sorted(e.body for e in got) == [b"SPARK-SECRET-%02d" % i for i in range(50)]
    assert_no_plaintext(str(dest), [b"SPARK-SECRET"])
    assert_no_plaintext(str(src), [b"SPARK-SECRET"])
    # A streaming read (availableNow) under a consumer name: it acknowledges what it wrote out.
    out = tmp_path / "stream"
    q = (
        spark.readStream.format("filechannel")
        .option("consumer", "enc-q")
        .option("keystore", ks)
        .option("maxEventsPerTrigger", "20")
        .load(str(src))
        .writeStream.format("parquet")
        .option("path", str(out / "out"))
        .option("checkpointLocation", str(out / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(120)
    assert q.exception() is None
    rows = spark.read.parquet(str(out / "out")).orderBy("position").collect()
    assert [bytes(r.body) for r in rows] == [b"SPARK-SECRET-%02d" % i for i in range(50)]
