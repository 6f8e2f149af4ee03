"""Encryption at rest: keystores, the ``Encryption`` option, and one cipher per data file.

This module owns everything secret: loading keys (a mapping, a keystore file
with a permission check, an environment variable, or a callable), deriving a
per-file key (HKDF-SHA256 from the master key and the random salt in the file
header), and sealing and opening PUT payloads with an AEAD (AES-256-GCM by
default, ChaCha20-Poly1305 as an option). The byte layouts it relies on (the
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
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import ConfigError, DecryptionError

AES_256_GCM: Final = 1
CHACHA20_POLY1305: Final = 2
CIPHERS: Final = {"aes-256-gcm": AES_256_GCM, "chacha20-poly1305": CHACHA20_POLY1305}
CIPHER_NAMES: Final = {v: k for k, v in CIPHERS.items()}
KEY_LEN: Final = 32
SALT_LEN: Final = 32
TAG_LEN: Final = 16
"""Bytes an encrypted PUT payload is longer than its plaintext (the AEAD tag)."""
KEY_ID_RE: Final = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
KEY_ID_RULE: Final = "1 to 64 characters of A-Z a-z 0-9 . _ : -"
_INFO: Final = b"filechannel/v1 data file key"
_BATCH_INFO: Final = b"filechannel/v2 batch tag key"
STAGING_INFO: Final = b"filechannel/v1 spark staging key"
_CHECK_NONCE: Final = bytes(12)  # woid 0 is never a record's: the key check's nonce is free
_NONCE_PAD: Final = bytes(4)
_U64: Final = struct.Struct("<Q")
INSTALL_HINT: Final = "encryption needs the cryptography package: pip install 'filechannel[crypto]'"

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


def check_key_id(key_id: object, what: str = "key id") -> str:
    """Return ``key_id`` if it is a valid key id, else raise ConfigError naming the rule."""
    if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
        raise ConfigError("encryption", f"{what} {key_id!r} is not valid: {KEY_ID_RULE}")
    return key_id


def _check_key(key_id: str, key: object, where: str) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ConfigError("encryption", f"key {key_id!r}{where} must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_LEN:
        raise ConfigError(
            "encryption", f"key {key_id!r}{where} is {len(key)} bytes; keys are {KEY_LEN} bytes (256 bits)"
        )
    return key


def parse_keystore(text: str | bytes, where: str) -> dict[str, bytes]:
    """Parse keystore JSON (an object of key id -> base64 key) into a dict of key bytes.

    Raises:
        ConfigError: Not a JSON object, a bad key id, bad base64 or a key of the wrong length.
    """
    try:
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError("encryption", f"keystore {where} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict) or not obj:
        raise ConfigError("encryption", f"keystore {where} must be a JSON object of key id -> base64 key")
    keys: dict[str, bytes] = {}
    for key_id, b64 in obj.items():
        check_key_id(key_id, f"keystore {where}: key id")
        if not isinstance(b64, str):
            raise ConfigError("encryption", f"keystore {where}: key {key_id!r} must be a base64 string")
        try:
            raw = base64.b64decode(b64.encode("ascii"), validate=True)
        except (ValueError, binascii.Error, UnicodeEncodeError):
            raise ConfigError("encryption", f"keystore {where}: key {key_id!r} is not valid base64") from None
        keys[key_id] = _check_key(key_id, raw, f" in keystore {where}")
    return keys


def load_keystore(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Load a keystore file, refusing one that group or others may read.

    Raises:
        ConfigError: Missing, readable by others, or malformed.
    """
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError as exc:
        raise ConfigError("encryption", f"cannot read keystore {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            raise ConfigError(
                "encryption",
                f"keystore {p} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can read it; "
                f"run `chmod 600 {p}`",
            )
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return parse_keystore(b"".join(chunks), p)


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
            raise ConfigError("encryption", f"cipher must be one of {sorted(CIPHERS)}, got {self.cipher!r}")
        _crypto()  # say at once when the crypto extra is missing
        k = self.keys
        lookup: Callable[[str], bytes | None]
        if isinstance(k, (str, os.PathLike)):
            loaded = load_keystore(k)
            object.__setattr__(self, "keys", os.fspath(k))
        elif isinstance(k, Mapping):
            loaded = {check_key_id(i): _check_key(i, v, "") for i, v in k.items()}
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
            raise ConfigError("encryption", f"active_key {active!r} is not among the keys")
        object.__setattr__(self, "active_key", active)
        object.__setattr__(self, "_lookup", lookup)

    @staticmethod
    def from_env(var: str) -> dict[str, bytes]:
        """Read keystore JSON (key id -> base64 key) from environment variable ``var``.

        Use the result as ``keys``: ``Encryption(keys=Encryption.from_env("FC_KEYS"), active_key="2026-11")``.

        Raises:
            ConfigError: The variable is not set, or its JSON is malformed.
        """
        text = os.environ.get(var)
        if text is None:
            raise ConfigError("encryption", f"environment variable {var} is not set (it should hold keystore JSON)")
        return parse_keystore(text, f"in ${var}")

    @property
    def suite(self) -> int:
        """The cipher suite number recorded in file headers."""
        return CIPHERS[self.cipher]

    def key(self, key_id: str) -> bytes | None:
        """Return the key with id ``key_id``, or None when it is not given."""
        v: bytes | None = self._lookup(key_id)
        return v

    def new_file_cipher(self, channel_id: bytes, file_id: int) -> FileCipher:
        """Return the cipher of a new data file: the active key, a fresh random salt."""
        assert self.active_key is not None
        key = self.key(self.active_key)
        assert key is not None
        return FileCipher(self.suite, self.active_key, os.urandom(SALT_LEN), key, channel_id, file_id)

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
            DecryptionError: No key is given for ``key_id``.
        """
        key = self.key(key_id)
        if key is None:
            raise DecryptionError(
                path, 0, f"staged file is encrypted with key id {key_id!r}, which is not in the keystore", key_id
            )
        return FileCipher(suite, key_id, salt, key, _name_id(name), 0, STAGING_INFO)

    def file_cipher(
        self, path: str, suite: int, key_id: str, salt: bytes, channel_id: bytes, file_id: int
    ) -> FileCipher:
        """Return the cipher of an existing data file.

        Raises:
            DecryptionError: No key is given for ``key_id``.
        """
        key = self.key(key_id)
        if key is None:
            raise DecryptionError(
                path,
                0,
                f"data file is encrypted with key id {key_id!r}, which is not among the keys given",
                key_id,
                KEY_HINT,
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
        )
    return cipher


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
