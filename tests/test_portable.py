"""Moved, copied, restored and half-missing channels: every committed event or a loud, exact error."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import contents, put

import filechannel
from filechannel.log import decode_meta

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False}


def make(path: str, n: int = 10, **kw: Any) -> list[tuple[int, bytes]]:
    with filechannel.open(path, **OPTS, **kw) as ch:
        for i in range(0, n, 5):
            put(ch, *[b"event-%d" % j for j in range(i, i + 5)])
        return contents(ch)


def test_moved_channel_keeps_every_event(tmp_path: Path) -> None:
    a, b = str(tmp_path / "m1"), str(tmp_path / "m2")
    expected = make(a)
    os.rename(a, b)
    with filechannel.open(b, **OPTS) as ch:
        assert contents(ch) == expected
    assert not os.path.exists(a), "opening the moved channel recreated the old path"
    recorded = decode_meta(Path(b, "DATA_DIRS").read_bytes(), "DATA_DIRS")
    assert recorded["data_dirs"] == ["data"]


def test_copy_is_an_independent_channel(tmp_path: Path) -> None:
    a, b = str(tmp_path / "c1"), str(tmp_path / "c2")
    expected = make(a)
    shutil.copytree(a, b, symlinks=True)
    with filechannel.open(b, **OPTS) as ch:
        tx = ch.transaction()
        assert len(tx.take_batch(3)) == 3
        tx.commit()
        assert len(contents(ch)) == len(expected) - 3
    with filechannel.open(a, **OPTS) as ch:
        assert contents(ch) == expected  # the original lost nothing
    # and both can be open at once: they share no file
    with filechannel.open(a, **OPTS) as c1, filechannel.open(b, **OPTS) as c2:
        assert c1.size == len(expected)
        assert c2.size == len(expected) - 3


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_missing_data_directory_is_an_error_not_an_empty_channel(tmp_path: Path, how: str) -> None:
    d = str(tmp_path / "ch")
    expected = make(d)
    data = os.path.join(d, "data")
    shutil.rmtree(data)
    if how == "emptied":  # an unmounted disk leaves an empty mount point
        os.mkdir(data)
    with pytest.raises(filechannel.CorruptLogError, match="data directory is") as ei:
        filechannel.open(d, **OPTS)
    assert ei.value.path == data
    assert "mount or restore" in str(ei.value)
    # Accepting the loss reports every event the checkpoint vouched for.
    with filechannel.open(d, **OPTS, on_corruption="skip") as ch:
        st = ch.stats()
        assert contents(ch) == []
        lost = {p for a, b in st["lost_positions"] for p in range(a, b)}
        assert lost == {p for p, _ in expected}
        put(ch, b"new")  # and the channel works again
    with filechannel.open(d, **OPTS) as ch:
        assert [b for _, b in contents(ch)] == [b"new"]


def test_foreign_data_directory_is_refused(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ext_a = str(tmp_path / "disk-a")
    make(a, data_dirs=[ext_a])
    make(b)
    shutil.rmtree(os.path.join(b, "data"))
    shutil.copytree(ext_a, os.path.join(b, "data"))
    with pytest.raises(filechannel.DataDirOwnershipError, match="belongs to another channel") as ei:
        filechannel.open(b, **OPTS)
    # Nothing is damaged: code that salvages on CorruptLogError must not fire.
    assert not isinstance(ei.value, filechannel.CorruptLogError)
    assert ei.value.data_dir == os.path.join(b, "data")


def test_refused_open_on_shared_data_dirs_leaves_the_holder_intact(tmp_path: Path) -> None:
    """A second channel refused because the first holds its data directories writes nothing into them."""
    dirs = [str(tmp_path / f"d{i}") for i in range(3)]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with filechannel.open(a, **OPTS, data_dirs=dirs):
        before = {d: Path(d, "DATADIR").read_bytes() for d in dirs}
        with pytest.raises(filechannel.ChannelLockedError):
            filechannel.open(b, **OPTS, data_dirs=dirs)
        assert {d: Path(d, "DATADIR").read_bytes() for d in dirs} == before
    with filechannel.open(a, **OPTS, data_dirs=dirs) as ch:  # reopens: the identities are still A's
        put(ch, b"x")
    # With A closed, B is refused as well: the directories are A's, and that is not damage.
    with pytest.raises(filechannel.DataDirOwnershipError, match="belongs to another channel") as ei:
        filechannel.open(b, **OPTS, data_dirs=dirs)
    assert not isinstance(ei.value, filechannel.CorruptLogError)
    assert "delete" in str(ei.value)
    with filechannel.open(a, **OPTS, data_dirs=dirs) as ch:
        assert [body for _, body in contents(ch)] == [b"x"]


def test_copy_sharing_an_external_data_directory_is_refused(tmp_path: Path) -> None:
    a, b, c = str(tmp_path / "c1"), str(tmp_path / "c2"), str(tmp_path / "c3")
    ext = str(tmp_path / "disk2")
    expected = make(a, data_dirs=[ext])
    shutil.copytree(a, b)
    with pytest.raises(filechannel.ChannelCopyError, match="is a copy of the channel in") as ei:
        filechannel.open(b, **OPTS)
    assert ei.value.original == os.path.abspath(a)
    with filechannel.open(a, **OPTS) as ch:
        assert contents(ch) == expected  # the original was not touched
    # Moving the channel directory (not copying) hands the data directory over.
    shutil.rmtree(b)
    os.rename(a, c)
    with filechannel.open(c, **OPTS) as ch:
        assert contents(ch) == expected
    ident = decode_meta(Path(ext, "DATADIR").read_bytes(), "identity")
    assert ident["owner"] == os.path.abspath(c)


def test_two_channels_never_share_a_data_directory_at_once(tmp_path: Path) -> None:
    # A half copy (the top files only) whose version-1 DATA_DIRS still names the original's data.
    a, b = str(tmp_path / "c1"), str(tmp_path / "c2")
    make(a)
    os.mkdir(b, 0o700)
    shutil.copy(os.path.join(a, "CHANNEL"), b)
    Path(b, "DATA_DIRS").write_text(json.dumps({"data_dirs": [os.path.join(os.path.abspath(a), "data")]}))
    with filechannel.open(a, **OPTS), pytest.raises(filechannel.ChannelLockedError) as ei:
        filechannel.open(b, **OPTS)
    assert ei.value.path == os.path.join(os.path.abspath(a), "data")


def test_version_1_data_dirs_of_a_moved_channel_is_upgraded(tmp_path: Path) -> None:
    # A channel written by 0.1 recorded the absolute path of its default data directory.
    a, b = str(tmp_path / "old"), str(tmp_path / "new")
    expected = make(a)
    Path(a, "DATA_DIRS").write_text(json.dumps({"data_dirs": [os.path.join(os.path.abspath(a), "data")]}))
    os.unlink(os.path.join(a, "data", "DATADIR"))
    os.rename(a, b)
    with filechannel.open(b, **OPTS) as ch:
        assert contents(ch) == expected
    assert decode_meta(Path(b, "DATA_DIRS").read_bytes(), "DATA_DIRS")["data_dirs"] == ["data"]
    assert Path(b, "data", "DATADIR").exists()


def test_damaged_data_dirs_file_is_reported(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    make(d)
    raw = bytearray(Path(d, "DATA_DIRS").read_bytes())
    raw[3] ^= 0x01
    Path(d, "DATA_DIRS").write_bytes(bytes(raw))
    with pytest.raises(filechannel.CorruptLogError, match="DATA_DIRS"):
        filechannel.open(d, **OPTS)


def test_backup_and_restore_as_documented(tmp_path: Path) -> None:
    # docs/backup.md: close (or stop the writer), copy the whole directory, restore it anywhere.
    d = str(tmp_path / "live")
    expected = make(d, n=20)
    backup = str(tmp_path / "backup.d")
    shutil.copytree(d, backup)
    with filechannel.open(d, **OPTS) as ch:  # life goes on in the original
        tx = ch.transaction()
        tx.take_batch(20)
        tx.commit()
    restored = str(tmp_path / "restored")
    shutil.copytree(backup, restored)
    with filechannel.open(restored, **OPTS) as ch:
        assert contents(ch) == expected
