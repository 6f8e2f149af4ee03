"""Syslog and RELP on the wire, with no I/O: bytes in, frames and events out (``--syslog``, ``--relp``).

This module owns the protocol side of the syslog sources, as a sans-I/O core
(the servers in ``syslog_source.py`` only move bytes):

- :class:`SyslogFramer`: RFC 6587 framing of a TCP stream. Octet counting
  (``LEN SP MSG``) or LF-terminated frames, chosen per connection by its first
  byte (a digit: octet counting). Every frame is bounded by ``max_frame``: a
  longer one is skipped (its bytes are read and dropped, never buffered) and
  reported as :class:`TooLarge`, and the stream goes on with the next frame.
  A count header that is not a number cannot be framed: the bytes up to the
  next LF come out as a frame with ``broken=True`` (kept, as an invalid frame).
- :func:`parse_syslog`: one frame as an event (body, headers): RFC 5424 or
  RFC 3164 (the traditional format, also with an RFC 3339 timestamp as
  rsyslog forwards it). Anything else is kept as is, with the header
  ``syslog.status=invalid``; nothing is dropped.
- :class:`RelpParser` and :func:`relp_frame`: RELP (rsyslog's reliable event
  logging protocol) frames ``TXNR SP COMMAND SP DATALEN [SP DATA] LF``. A
  frame that breaks the grammar raises :class:`RelpProtocolError` (the session
  cannot be resynchronised: the server closes it); a ``syslog`` frame whose
  data is over ``max_frame`` comes out as a :class:`RelpFrame` with
  ``too_large`` set and no data (its bytes are skipped, never buffered).

Parsers need more bytes or fail with a specific error; they never buffer more
than one frame's bytes (at most ``max_frame`` plus a header).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from filechannel.errors import ChannelError

__all__ = [
    "HEADERS",
    "INVALID",
    "STATUS_HEADER",
    "Frame",
    "RelpFrame",
    "RelpParser",
    "RelpProtocolError",
    "SyslogFramer",
    "TooLarge",
    "parse_syslog",
    "relp_frame",
]

# The headers a parsed frame may carry (absent when the message has no such field).
HEADERS = ("facility", "severity", "timestamp", "hostname", "appname", "procid", "msgid", "structured_data")
STATUS_HEADER = "syslog.status"
INVALID = "invalid"

MAX_COUNT_DIGITS = 10  # an octet count of more digits is not a count (and over any frame limit anyway)
_BOM = b"\xef\xbb\xbf"


class RelpProtocolError(ChannelError):
    """A RELP peer sent bytes that are not a RELP frame (the session is closed)."""


@dataclass(frozen=True)
class Frame:
    """One syslog frame: its exact bytes (without the framing), and whether the framing itself was broken."""

    data: bytes
    broken: bool = False


@dataclass(frozen=True)
class TooLarge:
    """A frame over the limit, skipped: ``size`` is its length (for LF framing: at least this many bytes)."""

    size: int


# -- RFC 6587 framing ----------------------------------------------------------------------------

_START, _COUNT, _DATA, _SKIP, _LINE, _SKIP_LINE, _BROKEN = range(7)


class SyslogFramer:
    """RFC 6587 frames of one TCP connection; feed it bytes as they arrive.

    Args:
        max_frame: The largest frame taken (bytes); longer ones come out as :class:`TooLarge`.

    Octet counting (``123 <13>1 ...``) when the connection's first byte is a
    digit, LF-terminated frames otherwise. Empty LF frames (blank lines) and
    LF/CR between octet-counted frames are skipped. At the end of the stream
    (:meth:`end`), an unterminated LF frame is a frame; a cut octet-counted one
    is kept as a broken frame.
    """

    def __init__(self, max_frame: int) -> None:
        if max_frame < 1:
            raise ValueError(f"max_frame must be >= 1, not {max_frame}")
        self.max_frame = max_frame
        self.octet_counting: bool | None = None  # decided by the first byte
        self._state = _START
        self._buf = bytearray()
        self._need = 0  # bytes of the frame (or skip) still to come

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not complete yet (at most ``max_frame`` plus a count header)."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame | TooLarge]:
        """The frames (and skipped frames) completed by ``data``, in order."""
        out: list[Frame | TooLarge] = []
        mv = memoryview(data)
        i, n = 0, len(data)
        while i < n:
            st = self._state
            if st == _START:
                self.octet_counting = 48 <= data[i] <= 57
                self._state = _COUNT if self.octet_counting else _LINE
            elif st == _COUNT:
                c = data[i]
                if 48 <= c <= 57:
                    self._buf.append(c)
                    i += 1
                    if len(self._buf) > MAX_COUNT_DIGITS:
                        self._state = _BROKEN
                elif c == 32 and self._buf:
                    size = int(self._buf)
                    self._buf.clear()
                    i += 1
                    if size > self.max_frame:
                        out.append(TooLarge(size))
                        self._state, self._need = _SKIP, size
                    elif size == 0:
                        out.append(Frame(b"", broken=False))
                    else:
                        self._state, self._need = _DATA, size
                elif c in (10, 13) and not self._buf:
                    i += 1  # a line end between frames (some senders add one)
                else:
                    self._state = _BROKEN
            elif st == _DATA:
                take = min(self._need, n - i)
                self._buf += mv[i : i + take]
                i += take
                self._need -= take
                if self._need == 0:
                    out.append(Frame(bytes(self._buf)))
                    self._buf.clear()
                    self._state = _COUNT
            elif st == _SKIP:
                take = min(self._need, n - i)
                i += take
                self._need -= take
                if self._need == 0:
                    self._state = _COUNT
            elif st == _BROKEN:
                # Not a count: keep the bytes up to the next LF as one broken frame, then count again.
                j = data.find(b"\n", i)
                end = n if j < 0 else j
                room = self.max_frame - len(self._buf)
                if end - i > room:
                    out.append(TooLarge(len(self._buf) + end - i))
                    self._buf.clear()
                    self._state = _SKIP_LINE
                    self._need = 0
                    continue
                self._buf += mv[i:end]
                i = end
                if j >= 0:
                    i += 1
                    out.append(Frame(bytes(self._buf), broken=True))
                    self._buf.clear()
                    self._state = _COUNT
            elif st == _LINE:
                j = data.find(b"\n", i)
                end = n if j < 0 else j
                if len(self._buf) + end - i > self.max_frame:
                    self._need = len(self._buf) + end - i
                    self._buf.clear()
                    if j >= 0:
                        out.append(TooLarge(self._need))
                        i = j + 1
                    else:
                        self._state = _SKIP_LINE
                        i = n
                    continue
                self._buf += mv[i:end]
                i = end
                if j >= 0:
                    i += 1
                    if self._buf:
                        out.append(Frame(bytes(self._buf)))
                        self._buf.clear()
            else:  # _SKIP_LINE: drop bytes up to the next LF, then report the skipped frame
                j = data.find(b"\n", i)
                if j < 0:
                    self._need += n - i
                    i = n
                else:
                    self._need += j - i
                    out.append(TooLarge(self._need))
                    self._need = 0
                    i = j + 1
                    self._state = _COUNT if self.octet_counting else _LINE
        return out

    def end(self) -> list[Frame | TooLarge]:
        """The stream ended: what is left (an unterminated LF frame, a cut frame kept as broken)."""
        out: list[Frame | TooLarge] = []
        st = self._state
        if st == _LINE and self._buf:
            out.append(Frame(bytes(self._buf)))
        elif st in (_DATA, _BROKEN) or (st == _COUNT and self._buf):
            out.append(Frame(bytes(self._buf), broken=True))
        elif st == _SKIP_LINE or (st == _SKIP and self._need):
            out.append(TooLarge(self._need))
        self._buf.clear()
        self._state = _START
        self._need = 0
        return out


# -- RFC 5424 and RFC 3164 -----------------------------------------------------------------------

_PRI = re.compile(rb"<([0-9]{1,3})>")
_TOKEN = rb"([!-~]{1,255})"
_5424 = re.compile(rb"([1-9][0-9]{0,2}) " + rb" ".join([_TOKEN] * 5) + rb" ")
_SD_ELEMENT = re.compile(rb'\[[^ =\]"]{1,32}(?: [^ =\]"]{1,32}="(?:[^"\\\]]|\\.)*")*\]', re.S)
_3164_TIME = re.compile(rb"([A-Z][a-z]{2} [ 0-9][0-9] [0-9]{2}:[0-9]{2}:[0-9]{2}) ")
_3339_TIME = re.compile(rb"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+(?:Z|[+-][0-9]{2}:[0-9]{2})) ")
_TAG = re.compile(rb"([!-9;-Z\\^-~]{1,48}?)(?:\[([!-Z\\^-~]{1,128})\])?: ?")
_HOST = re.compile(rb"([!-~]{1,255}) ")


def _invalid(frame: bytes) -> tuple[bytes, dict[str, str]]:
    return frame, {STATUS_HEADER: INVALID}


def parse_syslog(frame: bytes) -> tuple[bytes, dict[str, str]]:
    """One syslog message as ``(body, headers)``; never raises for any bytes.

    RFC 5424 (``<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID SD [MSG]``):
    every field that is not ``-`` becomes its header (``facility`` and
    ``severity`` as decimal numbers, ``structured_data`` as sent), MSG the body
    (its UTF-8 BOM and one trailing LF removed, as rsyslog does). RFC 3164 (``<PRI>TIMESTAMP HOSTNAME TAG[PID]: MSG``):
    ``timestamp`` as sent, ``appname`` and ``procid`` from the tag, the rest
    the body; a message with a PRI but no recognisable timestamp keeps the rest
    whole as its body (as RFC 3164 says a relay must). Anything without a valid
    PRI, an RFC 5424 message whose header does not parse, or header fields that
    are not UTF-8: the exact bytes as the body and ``syslog.status=invalid``.
    """
    m = _PRI.match(frame)
    if m is None:
        return _invalid(frame)
    pri = int(m.group(1))
    if pri > 191 or (len(m.group(1)) > 1 and m.group(1)[0] == 48):
        return _invalid(frame)
    headers = {"facility": str(pri >> 3), "severity": str(pri & 7)}
    rest = frame[m.end() :]
    try:
        parsed = _parse_5424(rest, headers) if rest[:2] == b"1 " else _parse_3164(rest, headers)
    except UnicodeDecodeError:
        return _invalid(frame)
    return parsed if parsed is not None else _invalid(frame)


def _parse_5424(rest: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]] | None:
    m = _5424.match(rest)
    if m is None:
        return None
    for name, value in zip(("timestamp", "hostname", "appname", "procid", "msgid"), m.groups()[1:], strict=True):
        if value != b"-":
            headers[name] = value.decode("ascii")
    i = m.end()
    if rest[i : i + 1] == b"-":
        i += 1
    else:
        start = i
        while rest[i : i + 1] == b"[":
            e = _SD_ELEMENT.match(rest, i)
            if e is None:
                return None
            i = e.end()
        if i == start:
            return None
        headers["structured_data"] = rest[start:i].decode("utf-8")
    if i == len(rest):
        return b"", headers
    if rest[i : i + 1] != b" ":
        return None
    body = rest[i + 1 :]
    if body.startswith(_BOM):
        body = body[3:]
    return _chomp(body), headers


def _parse_3164(rest: bytes, headers: dict[str, str]) -> tuple[bytes, dict[str, str]]:
    m = _3164_TIME.match(rest) or _3339_TIME.match(rest)
    if m is None:
        return _chomp(rest), headers
    headers["timestamp"] = m.group(1).decode("ascii")
    i = m.end()
    # A hostname, unless the next word is already the tag (``TAG:`` or ``TAG[PID]:``).
    t = _TAG.match(rest, i)
    if t is None:
        h = _HOST.match(rest, i)
        if h is not None:
            headers["hostname"] = h.group(1).decode("utf-8")
            i = h.end()
        t = _TAG.match(rest, i)
    if t is not None:
        headers["appname"] = t.group(1).decode("utf-8")
        if t.group(2) is not None:
            headers["procid"] = t.group(2).decode("utf-8")
        i = t.end()
    return _chomp(rest[i:]), headers


def _chomp(body: bytes) -> bytes:
    """One trailing LF off (rsyslog's forwarding templates end the message with one)."""
    return body[:-1] if body.endswith(b"\n") else body


# -- RELP -----------------------------------------------------------------------------------------

MAX_TXNR = 999_999_999
_COMMAND = re.compile(rb"[A-Za-z]{1,32}")
_R_TXNR, _R_CMD, _R_LEN, _R_DATA, _R_SKIP, _R_TRAILER = range(6)


@dataclass(frozen=True)
class RelpFrame:
    """One RELP frame: its transaction number, command and data (None when skipped as too large)."""

    txnr: int
    command: str
    data: bytes | None
    too_large: int = 0  # the data's length, when over the limit and skipped


class RelpParser:
    """The frames of one RELP session; feed it bytes as they arrive.

    Args:
        max_frame: The largest DATA taken (bytes); longer data is skipped and
            the frame comes out with ``too_large`` set.

    Raises (from :meth:`feed`):
        RelpProtocolError: Bytes that are not a RELP frame. The parser is then
            unusable (a RELP session cannot be resynchronised).
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._state = _R_TXNR
        self._buf = bytearray()
        self._txnr = 0
        self._cmd = ""
        self._len = 0
        self._need = 0
        self._failed: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not complete yet."""
        return len(self._buf)

    def _fail(self, why: str) -> RelpProtocolError:
        self._failed = why
        return RelpProtocolError(why)

    def feed(self, data: bytes) -> list[RelpFrame]:
        """The frames completed by ``data``, in order."""
        if self._failed is not None:
            raise RelpProtocolError(self._failed)
        out: list[RelpFrame] = []
        i, n = 0, len(data)
        while i < n:
            st = self._state
            if st in (_R_TXNR, _R_CMD, _R_LEN):
                c = data[i]
                if c == 32 or (st == _R_LEN and c == 10):
                    tok = bytes(self._buf)
                    self._buf.clear()
                    i += 1
                    if st == _R_TXNR:
                        if not tok.isdigit() or len(tok) > 9 or not 0 <= int(tok) <= MAX_TXNR:
                            raise self._fail(f"a RELP frame starts with a transaction number, not {tok[:20]!r}")
                        self._txnr, self._state = int(tok), _R_CMD
                    elif st == _R_CMD:
                        if _COMMAND.fullmatch(tok) is None:
                            raise self._fail(f"{tok[:40]!r} is not a RELP command")
                        self._cmd, self._state = tok.decode("ascii"), _R_LEN
                    else:
                        if not tok.isdigit() or len(tok) > 9:
                            raise self._fail(f"a RELP data length is a number, not {tok[:20]!r}")
                        self._len = int(tok)
                        if c == 10:  # no data
                            if self._len:
                                raise self._fail(f"a frame of {self._len} data bytes ends at once")
                            out.append(RelpFrame(self._txnr, self._cmd, b""))
                            self._state = _R_TXNR
                        elif self._len > self.max_frame:
                            self._state, self._need = _R_SKIP, self._len
                        else:
                            self._state, self._need = _R_DATA, self._len
                            if self._len == 0:
                                self._state = _R_TRAILER
                else:
                    self._buf.append(c)
                    i += 1
                    if len(self._buf) > 32:
                        raise self._fail("a RELP frame header field is over 32 bytes")
            elif st == _R_DATA:
                take = min(self._need, n - i)
                self._buf += data[i : i + take]
                i += take
                self._need -= take
                if self._need == 0:
                    self._state = _R_TRAILER
            elif st == _R_SKIP:
                take = min(self._need, n - i)
                i += take
                self._need -= take
                if self._need == 0:
                    self._state = _R_TRAILER
            else:  # _R_TRAILER
                if data[i] != 10:
                    raise self._fail(f"a RELP frame ends with LF, not {bytes([data[i]])!r}")
                i += 1
                if self._len > self.max_frame:
                    out.append(RelpFrame(self._txnr, self._cmd, None, too_large=self._len))
                else:
                    out.append(RelpFrame(self._txnr, self._cmd, bytes(self._buf)))
                self._buf.clear()
                self._state = _R_TXNR
        return out


def relp_frame(txnr: int, command: str, data: bytes = b"") -> bytes:
    """The bytes of one RELP frame (``rsp``, ``serverclose``...)."""
    if data:
        return b"%d %s %d %s\n" % (txnr, command.encode("ascii"), len(data), data)
    return b"%d %s 0\n" % (txnr, command.encode("ascii"))
