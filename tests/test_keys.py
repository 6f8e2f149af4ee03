"""Key handling (issue 23): no key material in messages, the keystore file checks, a safe keygen, header key ids."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import multiprocessing
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the crypto extra is not installed (README, Installing)")

import filechannel
from filechannel import cli as cli_mod
from filechannel import crypto
from filechannel import format as fmt
from filechannel.crypto import Encryption
from filechannel.errors import ConfigError, DecryptionError

OPTS: dict[str, Any] = {"minimum_required_space": 0, "background": False}
# The key id rule, spelled out here (not crypto.KEY_ID_RE) so a wrong regex there cannot pass these tests.
VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def write_json(path: Path, obj: object, mode: int = 0o600) -> str:
    path.write_text(json.dumps(obj))
    os.chmod(path, mode)
    return str(path)


def keystore(path: Path, keys: dict[str, bytes], mode: int = 0o600) -> str:
    return write_json(path, {k: base64.b64encode(v).decode() for k, v in keys.items()}, mode)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli_mod.main(list(argv))
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# 1. no key material in any message


def _secrets(key: bytes) -> list[str]:
    """The forms a key could be echoed in (also a prefix: no part of it may show)."""
    b64 = base64.b64encode(key).decode()
    url = base64.urlsafe_b64encode(key).decode()
    return [b64, b64[:16], url[:16], key.hex(), key.hex()[:16], key.hex().upper()[:16], repr(key)[2:18]]


def _chain_texts(exc: BaseException) -> list[str]:
    """str, repr and args of every exception behind ``exc`` (its ``__cause__`` / ``__context__`` chain)."""
    out: list[str] = []
    seen: set[int] = set()
    todo = [exc.__cause__, exc.__context__]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        out += [str(e), repr(e), *map(repr, e.args)]
        todo += [e.__cause__, e.__context__]
    return out


def _assert_hidden(exc: BaseException, key: bytes, caplog: pytest.LogCaptureFixture) -> None:
    texts = [str(exc), repr(exc), *map(str, exc.args), caplog.text]
    if isinstance(exc, ConfigError):
        texts.append(exc.reason)
    texts += _chain_texts(exc)
    for text in texts:
        for s in _secrets(key):
            assert s not in text, f"key material {s!r} in {text!r}"


@pytest.mark.parametrize(
    ("name", "entry", "expect"),
    [
        ("swapped", lambda b64, hx: {b64: "mykey"}, r"entry 1: key id <a string of 44 characters, not shown>.*swap"),
        ("swapped-2nd", lambda b64, hx: {"ok": b64, b64: "k2"}, r"entry 2: key id .*not valid.*swap"),
        ("swapped-hex", lambda b64, hx: {hx: "mykey"}, r"entry 1 \(key id <a string of 64 .*not valid base64.*swap"),
        ("hex-value", lambda b64, hx: {"mykey": hx}, r"entry 1 \(key id 'mykey'\).*48 bytes.*hex"),
        ("short", lambda b64, hx: {"a": b64[:-8]}, r"entry 1 \(key id 'a'\).*27 bytes"),
        ("not-a-string", lambda b64, hx: {"a": [b64]}, r"must be a base64 string, not a list"),
        ("bad-json", lambda b64, hx: f'{{"a": "{b64}" "b"}}', r"not valid JSON: Expecting ',' delimiter at line 1"),
    ],
)
def test_keystore_errors_never_echo_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, entry: Callable[[str, str], Any], expect: str
) -> None:
    caplog.set_level(logging.DEBUG)
    key = os.urandom(32)
    obj = entry(base64.b64encode(key).decode(), key.hex())
    path = tmp_path / "ks.json"
    if isinstance(obj, str):
        path.write_text(obj)
        os.chmod(path, 0o600)
    else:
        write_json(path, obj)
    with pytest.raises(ConfigError, match=expect) as ei:
        Encryption(keys=str(path))
    _assert_hidden(ei.value, key, caplog)
    assert str(path) in str(ei.value)  # it names the file
    text = path.read_text()
    os.environ["FC_TEST_KEYS_23"] = text
    try:
        with pytest.raises(ConfigError, match=expect) as ei:
            Encryption.from_env("FC_TEST_KEYS_23")
    finally:
        del os.environ["FC_TEST_KEYS_23"]
    assert "$FC_TEST_KEYS_23" in str(ei.value)
    _assert_hidden(ei.value, key, caplog)


def test_a_binary_key_file_as_keystore_shows_no_byte_of_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = b"\xff\xfe" + os.urandom(30)  # never UTF-8 (and FF FE: what json.loads alone would take for UTF-16)
    path = tmp_path / "raw.key"
    path.write_bytes(key)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=r"not valid JSON: not UTF-8 text \(at byte 0\)") as ei:
        Encryption(keys=str(path))
    _assert_hidden(ei.value, key, caplog)
    assert "0xff" not in str(ei.value)


@pytest.mark.parametrize(
    ("make", "expect"),
    [
        (lambda k: {"keys": {k: "mykey"}}, r"keys: entry 1: key id <a bytes value of 32 bytes.*swap"),
        (lambda k: {"keys": {"a": b"\x01" * 32, base64.b64encode(k).decode(): "b"}}, r"entry 2: key id <a str.*swap"),
        (lambda k: {"keys": {k.hex(): b"short"}}, r"key <a string of 64 characters, not shown> \(entry 1 of keys\)"),
        (lambda k: {"keys": {"a": base64.b64encode(k).decode()}}, r"key 'a' \(entry 1 of keys\) must be 32 bytes"),
        (lambda k: {"keys": {"a": k[:5] + k}}, r"key 'a' \(entry 1 of keys\) is 37 bytes"),
        (lambda k: {"keys": base64.b64encode(k).decode()}, r"looks like a key \(not shown\).*give keys="),
        (lambda k: {"keys": k.hex()}, r"looks like a key \(not shown\)"),
        (lambda k: {"keys": {"a": k}, "active_key": k.hex()}, r"active_key <a string of 64 .* not among"),
        (lambda k: {"keys": {"a": k}, "active_key": base64.b64encode(k).decode()}, r"active_key <a string.*not valid"),
        (lambda k: {"keys": {"a": k}, "active_key": k}, r"active_key <a bytes value of 32 bytes"),
    ],
)
def test_encryption_errors_never_echo_the_key(
    caplog: pytest.LogCaptureFixture, make: Callable[[bytes], dict[str, Any]], expect: str
) -> None:
    caplog.set_level(logging.DEBUG)
    key = os.urandom(32)
    with pytest.raises(ConfigError, match=expect) as ei:
        Encryption(**make(key))
    _assert_hidden(ei.value, key, caplog)


def test_a_good_short_id_is_still_named(tmp_path: Path) -> None:
    # Hiding only what could be a key: an ordinary id is still in the message (the user needs it).
    with pytest.raises(ConfigError, match="active_key '2026-12' is not among the keys"):
        Encryption(keys={"2026-11": os.urandom(32)}, active_key="2026-12")
    with pytest.raises(ConfigError, match=r"key id 'no spaces' is not valid \(1 to 64"):
        Encryption(keys={"no spaces": os.urandom(32)})


def test_keygen_on_a_swapped_keystore_echoes_no_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = os.urandom(32)
    ks = write_json(tmp_path / "ks.json", {base64.b64encode(key).decode(): "mykey"})
    code, err = cli(capsys, "keygen", ks, "--id", "k2")
    assert code == 2
    assert "did you swap the key id and the key?" in err
    for s in _secrets(key):
        assert s not in err
    code, err = cli(capsys, "stat", str(tmp_path / "ch"), "--keystore", ks)
    assert code == 2
    for s in _secrets(key):
        assert s not in err


def _pasted_keys() -> list[tuple[bytes, str]]:
    """A key as it may be pasted: standard base64, URL-safe base64 without padding, hex."""
    k = [os.urandom(32) for _ in range(3)]
    return [
        (k[0], base64.b64encode(k[0]).decode()),
        (k[1], base64.urlsafe_b64encode(k[1]).decode().rstrip("=")),
        (k[2], k[2].hex()),
    ]


@pytest.mark.parametrize("form", [0, 1, 2], ids=["base64", "urlsafe", "hex"])
def test_a_key_pasted_as_keystore_on_the_command_line_is_never_echoed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], form: int
) -> None:
    # Issue 32 item 11: "--keystore KEY: ... looks like a key (not shown)" showed it before the colon.
    key, text = _pasted_keys()[form]
    ch = tmp_path / "ch"
    with filechannel.open(str(ch), **OPTS) as c, c.transaction() as tx:
        tx.put(b"x")
    runs = [
        ("put", str(tmp_path / "new"), "--keystore", text),
        ("take", str(ch), "--keystore", text),
        ("peek", str(ch), "--keystore", text),
        ("stat", str(ch), "--keystore", text),
        ("verify", str(ch), "--keystore", text),
        ("keygen", text),  # a key given as the keystore's file name
        ("keygen", str(tmp_path / text.replace("/", "_"))),
    ]
    for argv in runs:
        code, err = cli(capsys, *argv)
        assert code == 2, (argv[0], err)
        assert "looks like a key (not shown)" in err, (argv[0], err)
        assert len(err.strip().splitlines()) == 1, err
        for s in [*_secrets(key), text, text[:16]]:
            assert s not in err, (argv[0], s, err)
    assert os.listdir(tmp_path) == ["ch"], "keygen made a file named after the key"


@pytest.mark.parametrize("form", [0, 1, 2], ids=["base64", "urlsafe", "hex"])
def test_a_key_pasted_as_cipher_env_name_or_encryption_is_never_echoed(
    chan_dir: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, form: int
) -> None:
    caplog.set_level(logging.DEBUG)
    key, text = _pasted_keys()[form]
    with pytest.raises(
        ConfigError, match=r"cipher must be one of .* got <a string of \d+ characters, not shown>"
    ) as ei:
        Encryption(keys={"a": os.urandom(32)}, cipher=text)
    _assert_hidden(ei.value, key, caplog)
    assert text not in repr(ei.value.args)
    with pytest.raises(ConfigError, match="not shown") as ei:
        Encryption.from_env(text)
    _assert_hidden(ei.value, key, caplog)
    assert text not in str(ei.value)
    if "=" not in text:  # a name the environment can hold: set, its JSON is bad, still not shown
        monkeypatch.setenv(text, "{}")
        with pytest.raises(ConfigError, match=r"keystore in \$<a string .* not shown> must be a JSON object") as ei:
            Encryption.from_env(text)
        _assert_hidden(ei.value, key, caplog)
        assert text not in str(ei.value)
    for given in (key, {"a": key}, bytearray(key)):
        # a key (or a mapping of keys) where an Encryption or a keystore path goes
        with pytest.raises(ConfigError, match=r"must be a filechannel.Encryption") as ei:
            filechannel.open(chan_dir, **OPTS, encryption=given)
        _assert_hidden(ei.value, key, caplog)
        with pytest.raises(ConfigError, match=r"must be a filechannel.Encryption or a keystore path, got <a ") as ei:
            crypto.as_encryption(given)  # type: ignore[arg-type]  # (the readers' and the agent client's way in)
        _assert_hidden(ei.value, key, caplog)


def test_an_ordinary_env_name_and_cipher_are_still_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FC_NOT_SET_32", raising=False)
    with pytest.raises(ConfigError, match="environment variable FC_NOT_SET_32 is not set"):
        Encryption.from_env("FC_NOT_SET_32")
    with pytest.raises(ConfigError, match="got 'aes-128-ctr'"):
        Encryption(keys={"a": os.urandom(32)}, cipher="aes-128-ctr")


# ------------------------------------------------------------------------------------------
# 2. the keystore file: a regular file, owned by this user or root, no group/other bits


def test_a_keystore_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    ks = keystore(tmp_path / "ks.json", {"a": os.urandom(32)})
    Encryption(keys=ks)
    os.chown(ks, 65534, os.getgid())
    with pytest.raises(ConfigError) as ei:
        Encryption(keys=ks)
    msg = str(ei.value)
    assert ks in msg
    assert "owned by uid 65534" in msg
    assert f"chown {os.geteuid()} {ks}" in msg


def test_owner_root_or_self_is_accepted_another_is_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ks = keystore(tmp_path / "ks.json", {"a": os.urandom(32)})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as if run by uid 1000
    os.chown(ks, 0, 0)
    assert Encryption(keys=ks).active_key == "a"  # root's file: root could read it anyway
    os.chown(ks, 1000, 0)
    assert Encryption(keys=ks).active_key == "a"
    os.chown(ks, 1001, 0)
    with pytest.raises(ConfigError, match=r"owned by uid 1001, not by this user \(uid 1000\) or root.*chown 1000"):
        Encryption(keys=ks)


def test_both_problems_are_named_at_once(tmp_path: Path) -> None:
    ks = keystore(tmp_path / "ks.json", {"a": os.urandom(32)}, 0o644)
    os.chown(ks, 65534, 0)
    with pytest.raises(ConfigError, match=r"owned by uid 65534.*; and it has mode 0644: group or others can read"):
        Encryption(keys=ks)
    os.chmod(ks, 0o610)  # no read bit, still refused: any group or other bit
    with pytest.raises(ConfigError, match=r"has mode 0610: group or others have permissions on it; run `chmod 600"):
        Encryption(keys=ks)


def test_a_directory_or_device_is_not_a_keystore(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=f"keystore {re.escape(str(d))} is a directory, not a regular file"):
        Encryption(keys=str(d))
    with pytest.raises(ConfigError, match="is a character device, not a regular file"):
        Encryption(keys="/dev/null")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    out: list[BaseException | None] = []

    def load() -> None:
        try:
            Encryption(keys=fifo)
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # it blocked in open(): let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        pytest.fail("loading a FIFO keystore blocked waiting for a writer")
    assert isinstance(out[0], ConfigError)
    assert "is a FIFO, not a regular file" in str(out[0])


def test_a_symlink_is_followed_and_its_target_checked(tmp_path: Path) -> None:
    real = keystore(tmp_path / "real.json", {"a": os.urandom(32)})
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert Encryption(keys=str(link)).active_key == "a"
    os.chmod(real, 0o644)
    with pytest.raises(ConfigError, match=f"keystore {link} \\(a link to {real}\\) has mode 0644"):
        Encryption(keys=str(link))


def test_the_checks_use_the_opened_file_not_a_second_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The link points at a good keystore when it is looked up, and at another user's file when it is
    # opened (a swap in between): what is read is what is checked.
    good = keystore(tmp_path / "good.json", {"a": os.urandom(32)})
    evil = keystore(tmp_path / "evil.json", {"a": os.urandom(32)})
    os.chown(evil, 65534, 0)
    link = tmp_path / "link.json"
    link.symlink_to(good)
    real_stat = os.stat

    def stat_then_swap(p: Any, *args: Any, **kw: Any) -> os.stat_result:
        st = real_stat(p, *args, **kw)
        if os.fspath(p) == str(link):
            link.unlink()
            link.symlink_to(evil)
        return st

    monkeypatch.setattr(os, "stat", stat_then_swap)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        Encryption(keys=str(link))


# ------------------------------------------------------------------------------------------
# 3. keygen: concurrent runs and symlinks


def _keygen_child(ks: str, key_id: str, barrier: Any, codes: Any, i: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    barrier.wait()
    try:
        codes[i] = cli_mod.main(["keygen", ks, "--id", key_id])
    except BaseException:
        codes[i] = 99
    os._exit(0)


def test_concurrent_keygens_each_add_their_key(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    n, rounds = 6, 5
    ks = str(tmp_path / "keys.json")  # absent at round 0: concurrent creation too
    want: list[str] = []
    for r in range(rounds):
        barrier = ctx.Barrier(n)
        codes = ctx.Array("i", [-1] * n)
        ids = [f"r{r}-p{i}" for i in range(n)]
        procs = [ctx.Process(target=_keygen_child, args=(ks, ids[i], barrier, codes, i)) for i in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert list(codes) == [0] * n
        want += ids
        have = crypto.load_keystore(ks)
        assert sorted(have) == sorted(want), f"round {r}: lost {sorted(set(want) - set(have))}"
        assert len(set(have.values())) == len(have)  # every key its own
    assert stat.S_IMODE(os.stat(ks).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(ks + ".lock").st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["keys.json", "keys.json.lock"]  # no temp file left


def test_keygen_through_a_symlink_writes_the_target_and_keeps_the_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    target = secret / "keys.json"
    link = tmp_path / "keys.json"
    link.symlink_to(target)  # dangling: keygen creates the target
    code, err = cli(capsys, "keygen", str(link), "--id", "k1")
    assert code == 0, err
    assert link.is_symlink()
    code, err = cli(capsys, "keygen", str(link), "--id", "k2")
    assert code == 0, err
    assert f"(a link to {target})" in err
    assert link.is_symlink()
    assert os.readlink(link) == str(target)
    assert list(json.loads(target.read_text())) == ["k1", "k2"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert os.path.exists(str(target) + ".lock")
    assert Encryption(keys=str(link)).active_key == "k2"


def test_keygen_refuses_a_keystore_another_user_owns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ks = keystore(tmp_path / "ks.json", {"a": os.urandom(32)})
    os.chown(ks, 65534, 0)
    before = Path(ks).read_bytes()
    code, err = cli(capsys, "keygen", ks, "--id", "b")
    assert code == 2
    assert err.startswith("filechannel: error: keystore ")
    assert "owned by uid 65534" in err
    assert err.count("\n") == 1
    assert "Traceback" not in err
    assert Path(ks).read_bytes() == before
    assert os.stat(ks).st_uid == 65534


# ------------------------------------------------------------------------------------------
# 4. key ids read from data file headers are checked before any lookup


BAD_IDS = ["a/b", "../../etc/passwd", "k1\n", "x" * 200, "a b", "k1;rm"]


def _recording_keys(key: bytes) -> tuple[Encryption, list[object]]:
    calls: list[object] = []

    def lookup(key_id: str) -> bytes:
        calls.append(key_id)
        if key_id == "k1":
            return key
        raise KeyError(key_id)

    return Encryption(keys=lookup, active_key="k1"), calls


def _rewrite_key_id(chan_dir: str, key_id: str) -> str:
    data = os.path.join(chan_dir, "data")
    path = os.path.join(data, sorted(n for n in os.listdir(data) if n.endswith(".wal"))[0])
    buf = Path(path).read_bytes()
    h = fmt.decode_file_header(buf)
    assert isinstance(h, fmt.FileHeader)
    assert h.cipher
    crafted = dataclasses.replace(h, key_id=key_id)
    Path(path).write_bytes(fmt.encode_file_header(crafted) + buf[h.header_len :])
    back = fmt.decode_file_header(Path(path).read_bytes())
    assert isinstance(back, fmt.FileHeader)
    assert back.key_id == key_id
    return path


@pytest.mark.parametrize("bad", BAD_IDS)
def test_a_crafted_header_key_id_never_reaches_the_keys_callable(chan_dir: str, bad: str) -> None:
    key = os.urandom(32)
    e, calls = _recording_keys(key)
    with filechannel.open(chan_dir, encryption=e, **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"x")
    path = _rewrite_key_id(chan_dir, bad)
    calls.clear()
    with pytest.raises(DecryptionError) as ei:
        filechannel.open(chan_dir, encryption=e, **OPTS)
    assert all(isinstance(c, str) and VALID_ID.fullmatch(c) for c in calls), calls
    assert "names a key id that is not valid" in str(ei.value)
    assert ei.value.path == path
    assert ei.value.key_id == ""  # no valid key id; not None: the CLI does not suggest --on-corruption skip
    with pytest.raises(DecryptionError, match="names a key id that is not valid"):
        filechannel.ChannelReader(chan_dir, encryption=e).available()
    with pytest.raises(DecryptionError, match="names a key id that is not valid"):
        filechannel.open(chan_dir, **OPTS)  # no encryption=: still named as damage
    assert all(isinstance(c, str) and VALID_ID.fullmatch(c) for c in calls), calls
    assert bad not in calls
    if len(bad) > 64:
        assert bad not in str(ei.value)  # described, not repeated


@pytest.mark.parametrize("bad", [*BAD_IDS, "ké", "k\ufffd", "", "k\x00"])
def test_every_lookup_entry_point_checks_the_id(bad: str) -> None:
    key = os.urandom(32)
    e, calls = _recording_keys(key)
    calls.clear()
    assert e.key(bad) is None
    assert calls == []
    h = fmt.FileHeader(1, bytes(16), 7, 0, 0, 0, 0, cipher=1, key_id=bad, salt=bytes(32), key_check=bytes(16))
    with pytest.raises(DecryptionError, match="not valid") as ei:
        crypto.header_cipher(e, "/d/seg-7.wal", h, b"", bytes(16))
    assert ei.value.path == "/d/seg-7.wal"
    with pytest.raises(DecryptionError, match="not valid"):
        crypto.header_cipher(None, "/d/seg-7.wal", h, b"", bytes(16))
    with pytest.raises(DecryptionError, match="data file's header names a key id that is not valid"):
        e.file_cipher("/d/seg-7.wal", 1, bad, bytes(32), bytes(16), 7)
    with pytest.raises(DecryptionError, match="staged file's header names a key id that is not valid"):
        e.staged_file_cipher("/d/stage-1", "stage-1", 1, bad, bytes(32))
    assert e.key(bad) is None
    assert calls == []


def test_an_unknown_suite_names_the_file() -> None:
    e = Encryption(keys={"k1": os.urandom(32)})
    with pytest.raises(DecryptionError, match="unknown cipher suite 9") as ei:
        e.file_cipher("/d/seg-7.wal", 9, "k1", bytes(32), bytes(16), 7)
    assert ei.value.path == "/d/seg-7.wal"


def test_the_cli_reports_a_crafted_header_key_id_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ks = keystore(tmp_path / "ks.json", {"k1": os.urandom(32)})
    d = str(tmp_path / "ch")
    with filechannel.open(d, encryption=Encryption(keys=ks), **OPTS) as ch, ch.transaction() as tx:
        tx.put(b"x")
    path = _rewrite_key_id(d, "../k1")
    code, err = cli(capsys, "take", d, "--keystore", ks, "--on-corruption", "skip")
    assert code == 2
    assert err.startswith(f"filechannel: error: {path} at byte 0: the data file's header names a key id that is not")
    assert "--on-corruption skip" not in err  # it would not help: the header is refused at open
    assert err.count("\n") == 1
