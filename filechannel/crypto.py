"""Encryption at rest: keystores, the ``Encryption`` option, and one cipher per data file.

This module owns everything secret: loading keys (a mapping, a keystore file
with a permission check, an environment variable, or a callable), deriving a
per-file key (HKDF-SHA256 from the master key and the random salt in the file
header), and sealing and opening PUT and MARK payloads with an AEAD (AES-256-GCM by
default, ChaCha20-Poly1305 as an option), and checkpoints' marks tables. The byte layouts it relies on (the
header extension, the nonce and the associated data) are in ``docs/format.md``;
``format.py`` stays pure and only calls the ``seal``/``key_check`` functions it
is handed.

The ``cryptography`` package (the ``crypto`` extra) is imported lazily, the
first time a key is derived: ``import filechannel`` never imports it.

Nonces: a record's nonce is its write-order id (unique within a file, since
woids strictly increase and a data file is never appended to after the channel
is reopened); each file has its own key, so no (key, nonce) pair is ever used
twice. The associated data binds a record to its channel, file, offset and
frame header, so a record moved, copied, retyped or renumbered fails its tag.
Key bytes never appear in a ``repr``, a log line or an exception message.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import stat
import struct
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Final

from ._fs import exclusive_lock
from .errors import ConfigError, DecryptionError

AES_256_GCM: Final = 1
CHACHA20_POLY1305: Final = 2
CIPHERS: Final = {"aes-256-gcm": AES_256_GCM, "chacha20-poly1305": CHACHA20_POLY1305}
CIPHER_NAMES: Final = {v: k for k, v in CIPHERS.items()}
KEY_LEN: Final = 32
SALT_LEN: Final = 32
TAG_LEN: Final = 16
"""Bytes an encrypted PUT payload is longer than its plaintext (the AEAD tag)."""
KEY_ID_RE: Final = re.compile(r"^[A-Za-z0-9._:-]{1,64}\Z")  # \Z: "$" would let a trailing newline in
KEY_ID_RULE: Final = "1 to 64 characters of A-Z a-z 0-9 . _ : -"
_INFO: Final = b"filechannel/v1 data file key"
_BATCH_INFO: Final = b"filechannel/v2 batch tag key"
_META_INFO: Final = b"filechannel/v2 metadata mac key"
_MARKS_INFO: Final = b"filechannel/v2 checkpoint marks key"
META_TAG_LEN: Final = 32
"""Bytes of a small file's MAC (HMAC-SHA256)."""
STAGING_INFO: Final = b"filechannel/v1 spark staging key"
_CHECK_NONCE: Final = bytes(12)  # woid 0 is never a record's: the key check's nonce is free
_NONCE_PAD: Final = bytes(4)
_U64: Final = struct.Struct("<Q")
INSTALL_HINT: Final = "encryption needs the cryptography package: pip install '.[crypto]' in filechannel's clone"

KeySource = Mapping[str, bytes] | str | os.PathLike[str] | Callable[[str], bytes]


def _crypto() -> Any:
    """Import the ``cryptography`` primitives (lazily)."""
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers import aead
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as exc:
        raise ConfigError("encryption", INSTALL_HINT) from exc
    return hashes, aead, HKDF


_HEX_KEY_RE: Final = re.compile(r"[0-9A-Fa-f]{64}")
_MAX_KEYSTORE: Final = 1 << 20
"""Largest keystore file read (about 17 000 keys): a bigger file is refused, not read into memory."""
_FILE_KINDS: Final = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def could_be_key(value: object) -> bool:
    """Return whether ``value`` could hold a 32-byte key: such a value is never shown in a message.

    True for 32 bytes, 64 hex digits, or text that decodes as (standard or URL-safe, padded or not)
    base64 to 32 bytes.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value) == KEY_LEN
    if not isinstance(value, str):
        return False
    v = value.strip()
    if _HEX_KEY_RE.fullmatch(v):
        return True
    if not 42 <= len(v) <= 46:
        return False
    padded = v.rstrip("=") + "=" * (-len(v.rstrip("=")) % 4)
    for alt in ("+/", "-_"):
        try:
            if len(base64.b64decode(padded, altchars=alt.encode("ascii"), validate=True)) == KEY_LEN:
                return True
        except (ValueError, binascii.Error):
            pass
    return False


def show_id(key_id: object) -> str:
    """Return ``key_id`` quoted for a message, or a description of it when it could be key material.

    A value is shown only when it is short printable text (under 65 characters) that cannot be
    an encoded key (:func:`could_be_key`); anything else is described by its type and length.
    """
    if isinstance(key_id, str) and len(key_id) <= 64 and key_id.isprintable() and not could_be_key(key_id):
        return repr(key_id)
    if isinstance(key_id, str):
        return f"<a string of {len(key_id)} characters, not shown>"
    if isinstance(key_id, (bytes, bytearray, memoryview)):
        return f"<a {type(key_id).__name__} value of {len(key_id)} bytes, not shown>"
    return f"<a {type(key_id).__name__}, not shown>"


def check_key_id(key_id: object, what: str = "key id", swapped: bool = False) -> str:
    """Return ``key_id`` if it is a valid key id, else raise ConfigError naming the rule.

    The message never repeats a value that could be a key (:func:`show_id`); ``swapped``
    (or an id that looks like a key) adds the hint that id and key may be swapped.
    """
    if isinstance(key_id, str) and KEY_ID_RE.match(key_id):
        return key_id
    hint = "; did you swap the key id and the key?" if swapped or could_be_key(key_id) else ""
    raise ConfigError("encryption", f"{what} {show_id(key_id)} is not valid ({KEY_ID_RULE}){hint}")


def _check_key(key_id: str, key: object, where: str) -> bytes:
    """Return ``key`` as bytes if it is a 32-byte key; the message names ``where``, never the key."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ConfigError(
            "encryption", f"key {show_id(key_id)}{where} must be {KEY_LEN} bytes, got a {type(key).__name__}"
        )
    key = bytes(key)
    if len(key) != KEY_LEN:
        raise ConfigError(
            "encryption",
            f"key {show_id(key_id)}{where} is {len(key)} bytes; keys are {KEY_LEN} bytes (256 bits)",
        )
    return key


def parse_keystore(text: str | bytes, where: str) -> dict[str, bytes]:
    """Parse keystore JSON (an object of key id -> base64 key) into a dict of key bytes.

    Messages name the entry (1-based, in file order) and the rule it breaks; they never
    repeat a value that could be a key (an id and a key swapped, say).

    Raises:
        ConfigError: Not a JSON object, a bad key id, bad base64 or a key of the wrong length.
    """
    # Each error is raised after its ``except`` block: a decoding error holds the text (the keys),
    # and an exception raised inside the block would keep it as ``__context__`` (even ``from None``).
    why = ""
    try:
        # UTF-8, as RFC 8259 says: json.loads would take bytes starting FF FE as UTF-16 (and a raw
        # key file could start so), then report a JSON error instead of "not UTF-8 text".
        obj = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 text (at byte {exc.start})"
    except json.JSONDecodeError as exc:
        why = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except ValueError:
        why = "not JSON"
    if why:
        raise ConfigError("encryption", f"keystore {where} is not valid JSON: {why}")
    if not isinstance(obj, dict) or not obj:
        raise ConfigError("encryption", f"keystore {where} must be a JSON object of key id -> base64 key")
    keys: dict[str, bytes] = {}
    for n, (key_id, b64) in enumerate(obj.items(), 1):
        swap = "; did you swap the key id and the key?"
        value_is_an_id = isinstance(b64, str) and bool(KEY_ID_RE.match(b64))
        check_key_id(key_id, f"keystore {where}: entry {n}: key id", value_is_an_id)
        entry = f"entry {n} (key id {show_id(key_id)}) of keystore {where}"
        if not could_be_key(key_id):
            swap = ""
        if not isinstance(b64, str):
            raise ConfigError("encryption", f"{entry}: the key must be a base64 string, not a {type(b64).__name__}")
        raw = _b64decode(b64)
        if raw is None:
            raise ConfigError(
                "encryption", f"{entry}: the key is not valid base64 (A-Z a-z 0-9 + / and = padding){swap}"
            )
        if len(raw) != KEY_LEN:
            if _HEX_KEY_RE.fullmatch(b64):
                swap += "; it looks like hex: a keystore holds base64 keys"
            raise ConfigError(
                "encryption", f"{entry}: the key is {len(raw)} bytes; keys are {KEY_LEN} bytes (256 bits){swap}"
            )
        keys[key_id] = raw
    return keys


def _b64decode(text: str) -> bytes | None:
    """Decode strict base64, or None (no exception escapes: it would hold the text)."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, binascii.Error, UnicodeEncodeError):
        return None


def _keystore_problems(st: os.stat_result, p: str) -> list[str]:
    """What makes the file ``st`` (opened as ``p``) unfit to be a keystore, each with its fix."""
    for test, kind in _FILE_KINDS:
        if test(st.st_mode):
            return [f"is {kind}, not a regular file: give the path of the keystore file itself"]
    if not stat.S_ISREG(st.st_mode):
        return ["is not a regular file: give the path of the keystore file itself"]
    out = []
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        out.append(
            f"is owned by uid {st.st_uid}, not by this user (uid {euid}) or root, so its owner can change "
            f"the keys: run `chown {euid} {p}`, or use a keystore of your own"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        who = "can read it" if mode & 0o044 else "have permissions on it"
        out.append(f"has mode {mode:04o}: group or others {who}; run `chmod 600 {p}`")
    return out


def load_keystore(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Load a keystore file: a regular file (a symlink's target), owned by this user or root, mode 0600.

    The checks are made with ``fstat`` on the descriptor that is read (never a
    second lookup of the path), and the file is opened non-blocking, so a FIFO
    is refused rather than waited on.

    Raises:
        ConfigError: Missing, not a regular file, owned by another user, group or
            others have permissions on it, or malformed.
    """
    p = os.fspath(path)
    failed = ""
    fd = -1
    problems: list[str] = []
    try:
        # A stat first, so a device or FIFO is not even opened; the fstat below decides.
        pre = os.stat(p)
        problems = _keystore_problems(pre, p) if not stat.S_ISREG(pre.st_mode) else []
        if not problems:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:  # raised below, not in this block: the OSError names the path
        failed = exc.strerror or type(exc).__name__
    if failed and could_be_key(p):
        raise ConfigError(
            "encryption",
            f"the keystore path is a string that looks like a key (not shown), and no such file can be read "
            f"({failed}): give keys={{key id: 32 key bytes}}, or the path of a keystore file",
        )
    if failed:
        raise ConfigError("encryption", f"cannot read keystore {p}: {failed}")
    try:
        if fd >= 0:
            st = os.fstat(fd)
            problems = _keystore_problems(st, p)
            if not problems and st.st_size > _MAX_KEYSTORE:
                problems = [f"is {st.st_size} bytes, larger than a keystore can be ({_MAX_KEYSTORE})"]
        if problems:
            real = os.path.realpath(p)
            link = f" (a link to {real})" if os.path.islink(p) else ""
            raise ConfigError("encryption", f"keystore {p}{link} " + "; and it ".join(problems))
        chunks = []
        got = 0
        while got <= _MAX_KEYSTORE and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            got += len(chunk)
    finally:
        if fd >= 0:
            os.close(fd)
    if got > _MAX_KEYSTORE:
        raise ConfigError("encryption", f"keystore {p} grew past {_MAX_KEYSTORE} bytes while it was read")
    return parse_keystore(b"".join(chunks), p)


def keystore_lock(path: str | os.PathLike[str]) -> AbstractContextManager[None]:
    """Hold the lock of the keystore at ``path`` (``<path>.lock``, mode 0600; waits for it).

    ``filechannel keygen`` holds it for its read-modify-write, so concurrent runs on one
    keystore each add their key. ``path`` should be resolved (``os.path.realpath``) first,
    so every name of the keystore (a symlink, say) takes the same lock.
    """
    return exclusive_lock(os.fspath(path) + ".lock")


def keystore_json(keys: Mapping[str, bytes]) -> bytes:
    """Encode keys as keystore JSON (one key per line, in order)."""
    lines = [f"  {json.dumps(k)}: {json.dumps(base64.b64encode(v).decode('ascii'))}" for k, v in keys.items()]
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode("ascii")


@dataclass(frozen=True)
class Encryption:
    """The ``encryption=`` option of :func:`filechannel.open`: keys and the one new files use.

    ``keys`` is a mapping of key id to 32-byte key, the path of a keystore file
    (a JSON object of key id to base64 key, mode 0600 or stricter), the result
    of :meth:`from_env`, or a callable from key id to key bytes. New data files
    are encrypted under ``active_key`` (default: the last key of a mapping or
    keystore, i.e. the one ``filechannel keygen`` added last); files written
    under other keys stay readable while their key is given.

    Raises:
        ConfigError: A malformed or exposed keystore, a key of the wrong length,
            an unknown cipher, or an ``active_key`` that is not among the keys.
    """

    keys: Any = field(repr=False)
    active_key: str | None = None
    cipher: str = "aes-256-gcm"
    _lookup: Any = field(init=False, repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle a keystore path, never key bytes (a Spark plan or a worker reloads the file)."""
        if not isinstance(self.keys, str):
            raise TypeError(
                "an Encryption holding keys in memory is not pickled (key bytes would travel): "
                "use a keystore path, e.g. Encryption(keys='/etc/filechannel/keys.json')"
            )
        return (Encryption, (self.keys, self.active_key, self.cipher))

    def __post_init__(self) -> None:
        """Load and check the keys (a keystore file is read here, once)."""
        if self.cipher not in CIPHERS:
            raise ConfigError("encryption", f"cipher must be one of {sorted(CIPHERS)}, got {show_id(self.cipher)}")
        _crypto()  # say at once when the crypto extra is missing
        k = self.keys
        lookup: Callable[[str], bytes | None]
        if isinstance(k, (str, os.PathLike)):
            loaded = load_keystore(k)
            object.__setattr__(self, "keys", os.fspath(k))
        elif isinstance(k, Mapping):
            loaded = _check_mapping(k)
            if not loaded:
                raise ConfigError("encryption", "keys is empty: give at least one key")
            object.__setattr__(self, "keys", dict(loaded))
        elif callable(k):
            loaded = None
        else:
            raise ConfigError(
                "encryption",
                f"keys must be a mapping of key id -> 32 bytes, a keystore path or a callable, got {type(k).__name__}",
            )
        if loaded is not None:
            lookup = loaded.get
            active = self.active_key if self.active_key is not None else list(loaded)[-1]
        else:
            fn = k

            def lookup(key_id: str) -> bytes | None:
                try:
                    v = fn(key_id)
                except KeyError:
                    return None
                return None if v is None else _check_key(key_id, v, " (from the keys callable)")

            if self.active_key is None:
                raise ConfigError("encryption", "active_key is required when keys is a callable")
            active = self.active_key
        check_key_id(active, "active_key")
        if lookup(active) is None:
            raise ConfigError("encryption", f"active_key {show_id(active)} is not among the keys")
        object.__setattr__(self, "active_key", active)
        object.__setattr__(self, "_lookup", lookup)

    @staticmethod
    def from_env(var: str) -> dict[str, bytes]:
        """Read keystore JSON (key id -> base64 key) from environment variable ``var``.

        Use the result as ``keys``: ``Encryption(keys=Encryption.from_env("FC_KEYS"), active_key="2026-11")``.

        Raises:
            ConfigError: The variable is not set, or its JSON is malformed.
        """
        if not isinstance(var, str) or not var or "=" in var or "\0" in var:
            raise ConfigError(
                "encryption", f"give the name of an environment variable (e.g. 'FC_KEYS'), not {show_id(var)}"
            )
        # The name is shown only when it cannot be a key (a key pasted where the name goes).
        shown = var if show_id(var) == repr(var) else show_id(var)
        text = os.environ.get(var)
        if text is None:
            raise ConfigError("encryption", f"environment variable {shown} is not set (it should hold keystore JSON)")
        return parse_keystore(text, f"in ${shown}")

    @property
    def suite(self) -> int:
        """The cipher suite number recorded in file headers."""
        return CIPHERS[self.cipher]

    def key(self, key_id: str) -> bytes | None:
        """Return the key with id ``key_id``, or None when it is not given.

        An id that breaks the key id rule (``KEY_ID_RE``; e.g. read from a damaged or
        crafted file header) is never looked up: it is None, and a keys callable is
        not called with it.
        """
        if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
            return None
        v: bytes | None = self._lookup(key_id)
        return v

    def new_file_cipher(self, channel_id: bytes, file_id: int) -> FileCipher:
        """Return the cipher of a new data file: the active key, a fresh random salt."""
        assert self.active_key is not None
        key = self.key(self.active_key)
        assert key is not None
        return FileCipher(self.suite, self.active_key, os.urandom(SALT_LEN), key, channel_id, file_id)

    def meta_mac(self, channel_id: bytes) -> MetaMac:
        """Return the MAC of this channel's small files (checkpoints, acks, ``DATA_DIRS``, ``DATADIR``, ``ANCHOR``)."""
        return MetaMac(self, channel_id)

    def staging_cipher(self, name: str) -> FileCipher:
        """Return a cipher for one staged file of the Spark sink (the active key, a fresh salt).

        ``name`` (the staged file's name, hashed) takes the channel id's place in the key
        derivation, under its own label, so a staged row never decrypts as a data record.
        """
        assert self.active_key is not None
        key = self.key(self.active_key)
        assert key is not None
        return FileCipher(self.suite, self.active_key, os.urandom(SALT_LEN), key, _name_id(name), 0, STAGING_INFO)

    def staged_file_cipher(self, path: str, name: str, suite: int, key_id: str, salt: bytes) -> FileCipher:
        """Return the cipher of an existing staged file.

        Raises:
            DecryptionError: ``key_id`` or ``suite`` is not valid (a damaged or crafted
                file), or no key is given for ``key_id``.
        """
        check_file_key_id(path, key_id, "staged file")
        _check_suite(path, suite, "staged file")
        key = self.key(key_id)
        if key is None:
            raise DecryptionError(
                path,
                0,
                f"staged file is encrypted with key id {key_id!r}, which is not in the keystore",
                key_id,
                wrong_key=True,
            )
        return FileCipher(suite, key_id, salt, key, _name_id(name), 0, STAGING_INFO)

    def file_cipher(
        self, path: str, suite: int, key_id: str, salt: bytes, channel_id: bytes, file_id: int
    ) -> FileCipher:
        """Return the cipher of an existing data file.

        Raises:
            DecryptionError: ``key_id`` or ``suite`` is not valid (a damaged or crafted
                header), or no key is given for ``key_id``.
        """
        check_file_key_id(path, key_id)
        _check_suite(path, suite)
        key = self.key(key_id)
        if key is None:
            raise DecryptionError(
                path,
                0,
                f"data file is encrypted with key id {key_id!r}, which is not among the keys given",
                key_id,
                KEY_HINT,
                wrong_key=True,
            )
        return FileCipher(suite, key_id, salt, key, channel_id, file_id)


KEY_HINT: Final = (
    "give the keys the channel was written with: filechannel.open(dir, encryption=filechannel.Encryption(keys=...)) "
    "or --keystore PATH"
)
TAMPERED: Final = (
    "record checksum is intact but its authentication tag fails: it was tampered with, or moved or copied "
    "from another place"
)
SEALED_WITHOUT_KEY: Final = (
    "the record says its event is encrypted, but its data file gives no key for it (a damaged file header, "
    "or the channel opened without encryption=): it is never decoded as plaintext"
)


def as_encryption(encryption: Encryption | str | os.PathLike[str] | None) -> Encryption | None:
    """An ``encryption=`` argument as an Encryption: a keystore path is loaded (its last key active)."""
    if encryption is None or isinstance(encryption, Encryption):
        return encryption
    if isinstance(encryption, (str, os.PathLike)):
        return Encryption(keys=os.fspath(encryption))
    raise ConfigError("encryption", f"must be a filechannel.Encryption or a keystore path, got {show_id(encryption)}")


def segment_cipher(segment: Any, encryption: Encryption | str | os.PathLike[str] | None) -> FileCipher | None:
    """The cipher of a segment's data file (a ``reader.Segment``), or None when it is plaintext.

    Raises:
        DecryptionError: The segment is encrypted and no keys, or no key for its key id, are given.
    """
    if not segment.cipher:
        return None
    enc = as_encryption(encryption)
    if enc is None:
        raise DecryptionError(
            segment.path,
            segment.offset,
            f"the segment is encrypted (key id {segment.key_id!r}); pass encryption= (a keystore path)",
            segment.key_id,
            KEY_HINT,
        )
    return enc.file_cipher(
        segment.path, segment.cipher, segment.key_id, segment.salt, segment.channel_id, segment.file_id
    )


def header_cipher(
    encryption: Encryption | None, path: str, header: Any, header_bytes: bytes | memoryview, channel_id: bytes
) -> FileCipher | None:
    """Return the cipher of a data file from its decoded header, checking the key; None for plaintext.

    ``header`` is a :class:`filechannel.format.FileHeader`, ``header_bytes`` the
    file's first bytes (at least the header).

    Raises:
        DecryptionError: The file is encrypted and ``encryption`` is None, has no
            key for its key id, or has the wrong key (the header's key check fails).
    """
    if not header.cipher:
        return None
    check_file_key_id(path, header.key_id)
    if encryption is None:
        raise DecryptionError(
            path,
            0,
            f"data file is encrypted (key id {header.key_id!r}), but the channel was opened without encryption=",
            header.key_id,
            KEY_HINT,
        )
    cipher = encryption.file_cipher(path, header.cipher, header.key_id, header.salt, channel_id, header.file_id)
    if not cipher.verify_key(bytes(header_bytes[: header.check_offset]), header.key_check):
        raise DecryptionError(
            path,
            header.check_offset,
            f"the key given for key id {header.key_id!r} is not the one this file was written with",
            header.key_id,
            KEY_HINT,
            wrong_key=True,
        )
    return cipher


def _check_mapping(keys: Mapping[Any, Any]) -> dict[str, bytes]:
    """Check a mapping of key id -> key; messages name the entry (1-based), never a key."""
    out: dict[str, bytes] = {}
    for n, (key_id, key) in enumerate(keys.items(), 1):
        check_key_id(key_id, f"keys: entry {n}: key id", isinstance(key, str) and bool(KEY_ID_RE.match(key)))
        out[key_id] = _check_key(key_id, key, f" (entry {n} of keys)")
    return out


def check_file_key_id(path: str, key_id: object, what: str = "data file") -> str:
    """Return a key id read from a file if it is valid, before it reaches a lookup.

    Raises:
        DecryptionError: The id breaks the key id rule: the file's header is damaged
            or forged. Its ``key_id`` is ``""``; the id is shown in the message only if
            it cannot be key material (:func:`show_id`).
    """
    if isinstance(key_id, str) and KEY_ID_RE.match(key_id):
        return key_id
    raise DecryptionError(
        path,
        0,
        f"the {what}'s header names a key id that is not valid {show_id(key_id)}: key ids are {KEY_ID_RULE}",
        "",  # a key problem (skip mode would not help), with no key id to name
        f"the {what}'s header is damaged or forged (its checksum is intact); no key was looked up for it, "
        "and its events cannot be decrypted: see docs/encryption.md",
    )


def _check_suite(path: str, suite: int, what: str = "data file") -> None:
    """Refuse an unknown cipher suite read from a file, naming the file."""
    if suite not in CIPHER_NAMES:
        raise DecryptionError(path, 0, f"the {what}'s header names an unknown cipher suite {suite}", None)


def _name_id(name: str) -> bytes:
    import hashlib

    return hashlib.sha256(name.encode("utf-8")).digest()[:16]


class FileCipher:
    """Seals and opens the PUT payloads of one data file (one cached AEAD object).

    ``seal(head, offset, payload)`` and ``open(head, offset, data)`` take the
    record's first 24 frame bytes (op, flags, length, woid, txn id) and its
    offset in the file; the nonce is the woid, the associated data is
    ``channel id || file id || offset || head``.
    """

    __slots__ = ("_aad_prefix", "_dec", "_enc", "_mac", "_mac_check", "file_id", "key_id", "salt", "suite")

    def __init__(
        self,
        suite: int,
        key_id: str,
        salt: bytes,
        key: bytes,
        channel_id: bytes,
        file_id: int,
        label: bytes = _INFO,
    ) -> None:
        hashes, aead, hkdf = _crypto()
        if suite not in CIPHER_NAMES:
            raise DecryptionError("", 0, f"unknown cipher suite {suite}", key_id)
        self.suite = suite
        self.key_id = key_id
        self.salt = salt
        self.file_id = file_id
        info = label + bytes([suite]) + channel_id + _U64.pack(file_id)
        subkey = hkdf(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=info).derive(key)
        cls = aead.AESGCM if suite == AES_256_GCM else aead.ChaCha20Poly1305
        a = cls(subkey)
        self._enc = a.encrypt
        self._dec = a.decrypt
        self._aad_prefix = channel_id + _U64.pack(file_id)
        # A data file's batch tags: a second key from the same master key and salt, under its own label.
        self._mac = self._mac_check = None
        if label == _INFO:
            mac_info = _BATCH_INFO + bytes([suite]) + channel_id + _U64.pack(file_id)
            mac = cls(hkdf(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=mac_info).derive(key))
            self._mac = mac.encrypt
            self._mac_check = mac.decrypt

    def key_check(self, header_prefix: bytes) -> bytes:
        """Return the 16-byte key check of a header: the tag over nothing, the header as AAD."""
        out: bytes = self._enc(_CHECK_NONCE, b"", header_prefix)
        return out

    def verify_key(self, header_prefix: bytes, check: bytes) -> bool:
        """Return whether ``check`` was made by this file's key (the right master key)."""
        try:
            self._dec(_CHECK_NONCE, check, header_prefix)
        except Exception:  # noqa: BLE001 - cryptography's InvalidTag
            return False
        return True

    def seal(self, head: bytes, offset: int, payload: bytes) -> bytes:
        """Encrypt one PUT payload; ``head`` is its frame's bytes [0, 24)."""
        out: bytes = self._enc(_NONCE_PAD + head[8:16], payload, self._aad_prefix + _U64.pack(offset) + head)
        return out

    def batch_tag(self, woid: int, data: bytes) -> bytes:
        """Return the 16-byte tag of an authenticated batch (``data`` as associated data, the woid as nonce)."""
        assert self._mac is not None, "only a data file's cipher tags batches"
        out: bytes = self._mac(_NONCE_PAD + _U64.pack(woid), b"", data)
        return out

    def check_batch(self, woid: int, data: bytes, tag: bytes) -> bool:
        """Return whether ``tag`` is the batch tag of ``data`` at ``woid`` under this file's key."""
        if self._mac_check is None:
            return False
        try:
            self._mac_check(_NONCE_PAD + _U64.pack(woid), tag, data)
        except Exception:  # noqa: BLE001 - cryptography's InvalidTag
            return False
        return True

    def open(self, head: bytes, offset: int, data: bytes) -> bytes | None:
        """Decrypt one PUT payload; None when its tag fails (tampered, moved or the wrong key)."""
        try:
            out: bytes = self._dec(_NONCE_PAD + head[8:16], data, self._aad_prefix + _U64.pack(offset) + head)
        except Exception:  # noqa: BLE001 - cryptography's InvalidTag
            return None
        return out


class MetaMac:
    """MACs an encrypted channel's small files: checkpoints, ``.ack`` files, ``DATA_DIRS``, ``DATADIR``, ``ANCHOR``.

    A tag is HMAC-SHA256 under a key derived (HKDF-SHA256, its own label) from a
    master key and the channel id, over ``role || 0x00 || body``: the role names
    the file (``"ack:reader-1"``, ``"checkpoint"``, ...), so a valid file moved
    to another role fails. New tags use the active key; a tag names its key id,
    so files written before a key rotation verify while that key is given.
    It also seals a checkpoint's marks table (:meth:`seal_table`).
    """

    __slots__ = ("_channel_id", "_enc", "_keys")

    def __init__(self, enc: Encryption, channel_id: bytes) -> None:
        self._enc = enc
        self._channel_id = channel_id
        self._keys: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"MetaMac(channel={self._channel_id.hex()})"

    @property
    def key_id(self) -> str:
        """The key id new tags are made with (the active key)."""
        assert self._enc.active_key is not None
        return self._enc.active_key

    def _key(self, key_id: str) -> bytes | None:
        k = self._keys.get(key_id)
        if k is None:
            master = self._enc.key(key_id)
            if master is None:
                return None
            hashes, _aead, hkdf = _crypto()
            k = hkdf(algorithm=hashes.SHA256(), length=KEY_LEN, salt=None, info=_META_INFO + self._channel_id).derive(
                master
            )
            self._keys[key_id] = k
        return k

    def tag(self, role: str, body: bytes | bytearray | memoryview) -> tuple[str, bytes]:
        """Return ``(key id, tag)`` of ``body`` in ``role`` under the active key."""
        import hmac

        key = self._key(self.key_id)
        assert key is not None
        return self.key_id, hmac.new(key, role.encode() + b"\0" + bytes(body), "sha256").digest()

    def seal_table(self, salt: bytes, aad: bytes, plaintext: bytes) -> tuple[str, int, bytes]:
        """Seal a checkpoint's marks table under the active key: ``(key id, cipher suite, ciphertext)``.

        Its key is HKDF-SHA256 of the master key, ``salt`` (fresh for each
        checkpoint) and info ``"filechannel/v2 checkpoint marks key" || suite ||
        channel id``; one message per key, so the nonce is 12 zero bytes.
        """
        suite = self._enc.suite
        out: bytes = self._table_aead(self.key_id, suite, salt, "").encrypt(_CHECK_NONCE, plaintext, aad)
        return self.key_id, suite, out

    def open_table(self, path: str, key_id: str, suite: int, salt: bytes, aad: bytes, data: bytes) -> bytes | None:
        """Open what :meth:`seal_table` sealed; None when it does not open (its tag fails, a bad key id or suite).

        Raises:
            DecryptionError: No key is given for ``key_id``.
        """
        if not KEY_ID_RE.match(key_id) or suite not in CIPHER_NAMES:
            return None
        aead = self._table_aead(key_id, suite, salt, path)
        try:
            out: bytes = aead.decrypt(_CHECK_NONCE, data, aad)
        except Exception:  # noqa: BLE001 - cryptography's InvalidTag
            return None
        return out

    def _table_aead(self, key_id: str, suite: int, salt: bytes, path: str) -> Any:
        """The AEAD of a checkpoint's marks table (see :meth:`seal_table`)."""
        master = self._enc.key(key_id)
        if master is None:
            raise DecryptionError(
                path,
                0,
                f"checkpoint marks are sealed with key id {key_id!r}, which is not among the keys given",
                key_id,
                KEY_HINT,
                wrong_key=True,
            )
        hashes, aead, hkdf = _crypto()
        info = _MARKS_INFO + bytes([suite]) + self._channel_id
        key = hkdf(algorithm=hashes.SHA256(), length=KEY_LEN, salt=salt, info=info).derive(master)
        return (aead.AESGCM if suite == AES_256_GCM else aead.ChaCha20Poly1305)(key)

    def hasher(self, role: str) -> _MacHasher:
        """Return an incremental form of :meth:`tag` (``update`` the body, then ``finish``)."""
        import hmac

        key = self._key(self.key_id)
        assert key is not None
        h = hmac.new(key, role.encode() + b"\0", "sha256")
        return _MacHasher(self.key_id, h)

    def check(self, path: str, role: str, body: bytes | bytearray | memoryview, key_id: str, tag: bytes) -> str | None:
        """Return None when ``tag`` authenticates ``body`` in ``role``, else the reason it does not.

        Raises:
            DecryptionError: No key is given for ``key_id`` (the file cannot be checked).
        """
        import hmac

        if not KEY_ID_RE.match(key_id):
            return f"its MAC names a key id that is not valid ({KEY_ID_RULE})"
        key = self._key(key_id)
        if key is None:
            raise DecryptionError(
                path,
                0,
                f"file is authenticated with key id {key_id!r}, which is not among the keys given",
                key_id,
                KEY_HINT,
                wrong_key=True,
            )
        want = hmac.new(key, role.encode() + b"\0" + bytes(body), "sha256").digest()
        if not hmac.compare_digest(want, tag):
            return "its MAC fails: it was edited, forged, or moved from another file or channel"
        return None


class _MacHasher:
    """:meth:`MetaMac.tag` fed block by block (a large checkpoint is never joined)."""

    __slots__ = ("_h", "key_id")

    def __init__(self, key_id: str, h: Any) -> None:
        self.key_id = key_id
        self._h = h

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def finish(self) -> tuple[str, bytes]:
        """Return ``(key id, tag)`` of everything fed so far."""
        return self.key_id, self._h.digest()
