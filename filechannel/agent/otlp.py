"""OTLP/HTTP logs as channel events: a pure decoder of ``ExportLogsServiceRequest`` and the answers.

This module owns the OTLP side of ``POST /v1/logs`` (the route lives in
``web.py``): no I/O, no protobuf runtime. It decodes the protobuf wire format
(``application/x-protobuf``) of the LogsData schema with a small reader of its
own, and the OTLP/JSON encoding (``application/json``: lowerCamelCase or
original field names, hex trace and span ids, 64-bit integers as strings or
numbers), into one event per LogRecord (``docs/otlp.md``):

- the body: a string body as its UTF-8 bytes, a bytes body as is, any other
  value (number, bool, array, map) as JSON;
- headers: each record attribute ``k`` -> ``k``; each resource attribute ``k``
  -> ``resource.k``; ``scope.name`` and ``scope.version`` where set; then
  ``severity_text``, ``severity_number``, ``time_unix_nano``,
  ``observed_time_unix_nano``, ``trace_id``, ``span_id`` (hex), ``flags`` and
  ``event_name`` where set (these win over an attribute of the same name).
  Attribute values: strings as is, bools ``true``/``false``, numbers in
  decimal, bytes in base64, arrays and maps as JSON.

Every length is checked against what is left of its message and nesting is
bounded (``MAX_DEPTH``), so any input gives events or :class:`OtlpDecodeError`
(a ``ValueError``), never another exception. Why not the ``opentelemetry-proto``
package: it pins a protobuf runtime (a C extension with its own version
ranges), and its generated classes raise ``DecodeError``, ``RecursionError``
or others on bad input; this reader is ~200 lines, fuzzed with Hypothesis,
and checked against the official encoder in the tests.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

from filechannel.errors import InvalidEventError

__all__ = [
    "MAX_DEPTH",
    "PROTOBUF_TYPE",
    "OtlpDecodeError",
    "decode_logs_json",
    "decode_logs_protobuf",
    "encode_response",
    "encode_status",
]

PROTOBUF_TYPE = "application/x-protobuf"
MAX_DEPTH = 32  # nested AnyValue arrays and maps
Event = tuple[bytes, dict[str, str]]


class OtlpDecodeError(InvalidEventError):
    """A body that is not an ``ExportLogsServiceRequest`` in the encoding its Content-Type says."""


# -- the protobuf wire format --------------------------------------------------------------

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(buf: bytes, i: int, end: int) -> tuple[int, int]:
    if i < end and buf[i] < 0x80:  # one byte: most tags and lengths
        return buf[i], i + 1
    shift = 0
    out = 0
    while True:
        if i >= end:
            raise OtlpDecodeError("a varint runs past the end of its message")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7
        if shift >= 70:
            raise OtlpDecodeError("a varint is longer than 10 bytes")


def _fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message in ``buf[start:end]``; LEN values as (start, end)."""
    i = start
    while i < end:
        key, i = _varint(buf, i, end)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise OtlpDecodeError("field number 0")
        if wt == _VARINT:
            v, i = _varint(buf, i, end)
            yield num, wt, v
        elif wt == _I64:
            if i + 8 > end:
                raise OtlpDecodeError("a fixed64 runs past the end of its message")
            yield num, wt, buf[i : i + 8]
            i += 8
        elif wt == _LEN:
            n, i = _varint(buf, i, end)
            if n > end - i:
                raise OtlpDecodeError(f"a length of {n} runs past the end of its message")
            yield num, wt, (i, i + n)
            i += n
        elif wt == _I32:
            if i + 4 > end:
                raise OtlpDecodeError("a fixed32 runs past the end of its message")
            yield num, wt, buf[i : i + 4]
            i += 4
        else:
            raise OtlpDecodeError(f"wire type {wt} (groups are not in OTLP)")


def _want(wt: int, expected: int, what: str) -> None:
    if wt != expected:
        raise OtlpDecodeError(f"{what} has wire type {wt}, not {expected}")


def _text(buf: bytes, span: tuple[int, int], what: str) -> str:
    try:
        return buf[span[0] : span[1]].decode("utf-8")
    except UnicodeDecodeError:
        raise OtlpDecodeError(f"{what} is not UTF-8") from None


def _pb_any(buf: bytes, start: int, end: int, depth: int) -> Any:
    """An AnyValue as a Python value: str, bool, int, float, bytes, list or dict (None: empty)."""
    if depth > MAX_DEPTH:
        raise OtlpDecodeError(f"values nest deeper than {MAX_DEPTH}")
    out: Any = None
    for num, wt, v in _fields(buf, start, end):
        if num == 1:
            _want(wt, _LEN, "string_value")
            out = _text(buf, v, "string_value")
        elif num == 2:
            _want(wt, _VARINT, "bool_value")
            out = bool(v)
        elif num == 3:
            _want(wt, _VARINT, "int_value")
            if v >= 1 << 64:
                raise OtlpDecodeError("int_value is over 64 bits")
            out = v - (1 << 64) if v >= 1 << 63 else v
        elif num == 4:
            _want(wt, _I64, "double_value")
            out = struct.unpack("<d", v)[0]
        elif num == 5:
            _want(wt, _LEN, "array_value")
            out = [
                _pb_any(buf, s, e, depth + 1) for n, w, (s, e) in _len_fields(buf, v, "array_value.values") if n == 1
            ]
        elif num == 6:
            _want(wt, _LEN, "kvlist_value")
            out = dict(
                _pb_kv(buf, s, e, depth + 1) for n, w, (s, e) in _len_fields(buf, v, "kvlist_value.values") if n == 1
            )
        elif num == 7:
            _want(wt, _LEN, "bytes_value")
            out = bytes(buf[v[0] : v[1]])
    return out


def _len_fields(buf: bytes, span: tuple[int, int], what: str) -> Iterator[tuple[int, int, tuple[int, int]]]:
    for num, wt, v in _fields(buf, span[0], span[1]):
        if num == 1:
            _want(wt, _LEN, what)
            yield num, wt, v


def _pb_kv(buf: bytes, start: int, end: int, depth: int) -> tuple[str, Any]:
    key = ""
    value: Any = None
    for num, wt, v in _fields(buf, start, end):
        if num == 1:
            _want(wt, _LEN, "KeyValue.key")
            key = _text(buf, v, "KeyValue.key")
        elif num == 2:
            _want(wt, _LEN, "KeyValue.value")
            value = _pb_any(buf, v[0], v[1], depth)
    return key, value


def _pb_attributes(buf: bytes, spans: list[tuple[int, int]]) -> dict[str, Any]:
    return dict(_pb_kv(buf, s, e, 1) for s, e in spans)


def _pb_record(buf: bytes, start: int, end: int) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    attrs: list[tuple[int, int]] = []
    for num, wt, v in _fields(buf, start, end):
        if num in (1, 11):
            _want(wt, _I64, "a LogRecord time")
            rec["time_unix_nano" if num == 1 else "observed_time_unix_nano"] = int.from_bytes(v, "little")
        elif num == 2:
            _want(wt, _VARINT, "severity_number")
            rec["severity_number"] = v
        elif num == 3:
            _want(wt, _LEN, "severity_text")
            rec["severity_text"] = _text(buf, v, "severity_text")
        elif num == 5:
            _want(wt, _LEN, "body")
            rec["body"] = _pb_any(buf, v[0], v[1], 1)
        elif num == 6:
            _want(wt, _LEN, "attributes")
            attrs.append(v)
        elif num == 8:
            _want(wt, _I32, "flags")
            rec["flags"] = int.from_bytes(v, "little")
        elif num in (9, 10):
            _want(wt, _LEN, "trace_id/span_id")
            rec["trace_id" if num == 9 else "span_id"] = buf[v[0] : v[1]].hex()
        elif num == 12:
            _want(wt, _LEN, "event_name")
            rec["event_name"] = _text(buf, v, "event_name")
    rec["attributes"] = _pb_attributes(buf, attrs)
    return rec


def _pb_scope(buf: bytes, start: int, end: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for num, wt, v in _fields(buf, start, end):
        if num in (1, 2):
            _want(wt, _LEN, "InstrumentationScope name/version")
            text = _text(buf, v, "InstrumentationScope name/version")
            if text:
                out["scope.name" if num == 1 else "scope.version"] = text
    return out


def decode_logs_protobuf(data: bytes) -> list[Event]:
    """The events of a protobuf ``ExportLogsServiceRequest``, one per LogRecord.

    Raises:
        OtlpDecodeError: Not such a message.
    """
    try:
        return _decode_pb(bytes(data))
    except RecursionError:  # pragma: no cover  (MAX_DEPTH keeps well below the interpreter's limit)
        raise OtlpDecodeError("values nest too deep") from None


def _decode_pb(buf: bytes) -> list[Event]:
    events: list[Event] = []
    for num, wt, rl in _fields(buf, 0, len(buf)):
        if num != 1:
            continue
        _want(wt, _LEN, "resource_logs")
        resource: dict[str, Any] = {}
        scopes: list[tuple[int, int]] = []
        for n2, w2, v2 in _fields(buf, rl[0], rl[1]):
            if n2 == 1:
                _want(w2, _LEN, "resource")
                spans = [s for n3, w3, s in _len_fields(buf, v2, "Resource.attributes")]
                resource.update(_pb_attributes(buf, spans))
            elif n2 == 2:
                _want(w2, _LEN, "scope_logs")
                scopes.append(v2)
        for s0, s1 in scopes:
            scope: dict[str, str] = {}
            records: list[dict[str, Any]] = []
            for n3, w3, v3 in _fields(buf, s0, s1):
                if n3 == 1:
                    _want(w3, _LEN, "scope")
                    scope = _pb_scope(buf, v3[0], v3[1])
                elif n3 == 2:
                    _want(w3, _LEN, "log_records")
                    records.append(_pb_record(buf, v3[0], v3[1]))
            events += [_event(r, resource, scope) for r in records]
    return events


# -- OTLP/JSON -----------------------------------------------------------------------------


def _get(obj: dict[str, Any], camel: str, snake: str) -> Any:
    return obj[camel] if camel in obj else obj.get(snake)


def _obj(v: Any, what: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise OtlpDecodeError(f"{what} is a JSON object, not {type(v).__name__}")
    return v


def _list(v: Any, what: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise OtlpDecodeError(f"{what} is a JSON list, not {type(v).__name__}")
    return v


def _int64(v: Any, what: str, unsigned: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str, float)):
        raise OtlpDecodeError(f"{what} is an integer (a number or a decimal string)")
    try:
        n = int(v) if not isinstance(v, float) else int(v) if v.is_integer() else None
    except ValueError:
        n = None
    lo, hi = (0, 1 << 64) if unsigned else (-(1 << 63), 1 << 63)
    if n is None or not lo <= n < hi:
        raise OtlpDecodeError(f"{what}: {v!r} is not a {'u' if unsigned else ''}int64")
    return n


def _hex_id(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise OtlpDecodeError(f"{what} is a hex string")
    try:
        return bytes.fromhex(v).hex()
    except ValueError:
        raise OtlpDecodeError(f"{what} is not hex") from None


def _json_any(v: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise OtlpDecodeError(f"values nest deeper than {MAX_DEPTH}")
    v = _obj(v, "an AnyValue")
    if "stringValue" in v or "string_value" in v:
        s = _get(v, "stringValue", "string_value")
        if not isinstance(s, str):
            raise OtlpDecodeError("stringValue is a string")
        return s
    if "boolValue" in v or "bool_value" in v:
        b = _get(v, "boolValue", "bool_value")
        if not isinstance(b, bool):
            raise OtlpDecodeError("boolValue is true or false")
        return b
    if "intValue" in v or "int_value" in v:
        return _int64(_get(v, "intValue", "int_value"), "intValue")
    if "doubleValue" in v or "double_value" in v:
        d = _get(v, "doubleValue", "double_value")
        if isinstance(d, str) and d in ("NaN", "Infinity", "-Infinity"):
            return float(d.replace("Infinity", "inf"))
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            raise OtlpDecodeError("doubleValue is a number")
        return float(d)
    if "arrayValue" in v or "array_value" in v:
        arr = _obj(_get(v, "arrayValue", "array_value"), "arrayValue")
        return [_json_any(x, depth + 1) for x in _list(arr.get("values"), "arrayValue.values")]
    if "kvlistValue" in v or "kvlist_value" in v:
        kv = _obj(_get(v, "kvlistValue", "kvlist_value"), "kvlistValue")
        return _json_attributes(kv.get("values"), depth + 1)
    if "bytesValue" in v or "bytes_value" in v:
        b64 = _get(v, "bytesValue", "bytes_value")
        if not isinstance(b64, str):
            raise OtlpDecodeError("bytesValue is a base64 string")
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise OtlpDecodeError("bytesValue is not base64") from None
    return None


def _json_attributes(v: Any, depth: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in _list(v, "attributes"):
        kv = _obj(kv, "a KeyValue")
        key = kv.get("key", "")
        if not isinstance(key, str):
            raise OtlpDecodeError("a KeyValue's key is a string")
        out[key] = _json_any(kv.get("value"), depth) if kv.get("value") is not None else None
    return out


_SEVERITY_NAMES = {"SEVERITY_NUMBER_UNSPECIFIED": 0} | {
    f"SEVERITY_NUMBER_{level}{i if i > 1 else ''}": base + i - 1
    for base, level in ((1, "TRACE"), (5, "DEBUG"), (9, "INFO"), (13, "WARN"), (17, "ERROR"), (21, "FATAL"))
    for i in range(1, 5)
}  # OTLP/JSON sends numbers; the names are taken too


def _json_record(r: Any) -> dict[str, Any]:
    r = _obj(r, "a LogRecord")
    rec: dict[str, Any] = {}
    for camel, snake in (("timeUnixNano", "time_unix_nano"), ("observedTimeUnixNano", "observed_time_unix_nano")):
        t = _get(r, camel, snake)
        if t is not None:
            rec[snake] = _int64(t, camel, unsigned=True)
    sev = _get(r, "severityNumber", "severity_number")
    if isinstance(sev, str) and sev in _SEVERITY_NAMES:
        sev = _SEVERITY_NAMES[sev]
    if sev is not None:
        if isinstance(sev, bool) or not isinstance(sev, int) or not 0 <= sev < 1 << 31:
            raise OtlpDecodeError("severityNumber is an integer (enums are numbers in OTLP/JSON)")
        rec["severity_number"] = sev
    for camel, snake in (("severityText", "severity_text"), ("eventName", "event_name")):
        s = _get(r, camel, snake)
        if s is not None:
            if not isinstance(s, str):
                raise OtlpDecodeError(f"{camel} is a string")
            rec[snake] = s
    body = r.get("body")
    if body is not None:
        rec["body"] = _json_any(body, 1)
    flags = r.get("flags")
    if flags is not None:
        rec["flags"] = _int64(flags, "flags", unsigned=True) & 0xFFFFFFFF
    for camel, snake in (("traceId", "trace_id"), ("spanId", "span_id")):
        t = _get(r, camel, snake)
        if t is not None:
            rec[snake] = _hex_id(t, camel)
    rec["attributes"] = _json_attributes(r.get("attributes"))
    return rec


def decode_logs_json(data: bytes) -> list[Event]:
    """The events of an OTLP/JSON ``ExportLogsServiceRequest``, one per LogRecord.

    Raises:
        OtlpDecodeError: Not such a document.
    """
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except UnicodeDecodeError:
        raise OtlpDecodeError("the body is not UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise OtlpDecodeError(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise OtlpDecodeError("the JSON nests too deep") from None
    events: list[Event] = []
    for rl in _list(_get(_obj(doc, "the body"), "resourceLogs", "resource_logs"), "resourceLogs"):
        rl = _obj(rl, "a ResourceLogs")
        resource = _json_attributes(_obj(rl.get("resource"), "resource").get("attributes"))
        for sl in _list(_get(rl, "scopeLogs", "scope_logs"), "scopeLogs"):
            sl = _obj(sl, "a ScopeLogs")
            sc = _obj(sl.get("scope"), "scope")
            scope: dict[str, str] = {}
            for key in ("name", "version"):
                val = sc.get(key)
                if val is not None and not isinstance(val, str):
                    raise OtlpDecodeError(f"scope.{key} is a string")
                if val:
                    scope[f"scope.{key}"] = val
            for r in _list(_get(sl, "logRecords", "log_records"), "logRecords"):
                events.append(_event(_json_record(r), resource, scope))
    return events


# -- records as events ---------------------------------------------------------------------


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _header_text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if v is None:
        return ""
    return json.dumps(_jsonable(v), separators=(",", ":"), ensure_ascii=False, sort_keys=True)


_FIXED = (
    "severity_text",
    "severity_number",
    "time_unix_nano",
    "observed_time_unix_nano",
    "trace_id",
    "span_id",
    "flags",
    "event_name",
)


def _event(rec: dict[str, Any], resource: dict[str, Any], scope: dict[str, str]) -> Event:
    body = rec.get("body")
    if isinstance(body, str):
        data = body.encode("utf-8", "surrogatepass")
    elif isinstance(body, bytes):
        data = body
    elif body is None:
        data = b""
    else:
        data = json.dumps(_jsonable(body), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    headers = {k: _header_text(v) for k, v in rec["attributes"].items()}
    headers.update({f"resource.{k}": _header_text(v) for k, v in resource.items()})
    headers.update(scope)
    for k in _FIXED:
        v = rec.get(k)
        if v is not None and v != "" and not (k in ("trace_id", "span_id") and not v.strip("0")):
            headers[k] = str(v)
    return data, headers


# -- answers -------------------------------------------------------------------------------


def _pb_len_field(num: int, payload: bytes) -> bytes:
    return _pb_varint((num << 3) | _LEN) + _pb_varint(len(payload)) + payload


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_response(json_encoding: bool, rejected: int = 0, message: str = "") -> bytes:
    """An ``ExportLogsServiceResponse``: empty, or with ``partial_success`` when records were rejected."""
    if json_encoding:
        doc: dict[str, Any] = {}
        if rejected or message:
            doc["partialSuccess"] = {"rejectedLogRecords": str(rejected), "errorMessage": message}
        return json.dumps(doc).encode()
    if not (rejected or message):
        return b""
    inner = b""
    if rejected:
        inner += _pb_varint((1 << 3) | _VARINT) + _pb_varint(rejected)
    if message:
        inner += _pb_len_field(2, message.encode("utf-8"))
    return _pb_len_field(1, inner)


# HTTP status -> google.rpc.Code, for the Status body of an error answer
_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 408: 4, 413: 8, 415: 3, 422: 3, 429: 8, 500: 13, 503: 14}


def encode_status(json_encoding: bool, http_status: int, message: str) -> bytes:
    """A ``google.rpc.Status`` (the body OTLP gives every 4xx and 5xx answer)."""
    code = _CODES.get(http_status, 2)
    if json_encoding:
        return json.dumps({"code": code, "message": message}).encode()
    return _pb_varint((1 << 3) | _VARINT) + _pb_varint(code) + _pb_len_field(2, message.encode("utf-8"))


Decoder = Callable[[bytes], list[Event]]
