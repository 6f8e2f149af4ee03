"""The pure parsers of the agent's push sources: OTLP logs (``otlp.py``) and Fluent forward (``forward.py``).

Each is fed bytes whole, one at a time, and with trailing garbage; any input
gives events or the parser's own error (``OtlpDecodeError``, ``ForwardError``),
never another exception. The OTLP decoder is checked against the official
protobuf classes (``opentelemetry-proto``) as the encoder.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from filechannel.agent import otlp

pytest.importorskip("msgpack")
pytest.importorskip("opentelemetry.proto")

import msgpack
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1 import common_pb2

from filechannel.agent.forward import ForwardDecoder, ForwardError, entry_event

# -- OTLP ------------------------------------------------------------------------------------

text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
scalars = st.one_of(
    text.map(lambda s: ("string_value", s)),
    st.booleans().map(lambda b: ("bool_value", b)),
    st.integers(-(1 << 63), (1 << 63) - 1).map(lambda i: ("int_value", i)),
    st.binary(max_size=10).map(lambda b: ("bytes_value", b)),
)


def _any(kind_value: tuple[str, Any]) -> common_pb2.AnyValue:
    kind, value = kind_value
    return common_pb2.AnyValue(**{kind: value})


def _expected_text(kind_value: tuple[str, Any]) -> str:
    kind, v = kind_value
    if kind == "bool_value":
        return "true" if v else "false"
    if kind == "bytes_value":
        import base64

        return base64.b64encode(v).decode()
    return str(v)


records = st.lists(
    st.fixed_dictionaries(
        {
            "body": text,
            "attrs": st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), scalars, max_size=3),
            "time": st.integers(0, (1 << 64) - 1),
            "severity": st.integers(0, 24),
            "trace": st.binary(min_size=16, max_size=16),
        }
    ),
    max_size=4,
)


def _request(recs: list[dict[str, Any]], resource: dict[str, str]) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    for k, v in resource.items():
        rl.resource.attributes.add(key=k, value=common_pb2.AnyValue(string_value=v))
    sl = rl.scope_logs.add()
    for r in recs:
        lr = sl.log_records.add(time_unix_nano=r["time"], severity_number=r["severity"], trace_id=r["trace"])
        lr.body.string_value = r["body"]
        for k, kv in r["attrs"].items():
            lr.attributes.add(key=k, value=_any(kv))
    return req


@given(records, st.dictionaries(st.from_regex(r"[a-z.]{1,8}", fullmatch=True), text, max_size=3))
def test_otlp_protobuf_and_json_decode_what_the_official_classes_encode(
    recs: list[dict[str, Any]], resource: dict[str, str]
) -> None:
    req = _request(recs, resource)
    events = otlp.decode_logs_protobuf(req.SerializeToString())
    assert len(events) == len(recs)
    for (body, headers), r in zip(events, recs, strict=True):
        assert body == r["body"].encode()
        for k, kv in r["attrs"].items():
            if k not in ("flags",):
                assert headers[k] == _expected_text(kv)
        for k, v in resource.items():
            assert headers[f"resource.{k}"] == v
        assert headers.get("time_unix_nano") == (str(r["time"]) if r["time"] else None)
        assert headers.get("severity_number") == (str(r["severity"]) if r["severity"] else None)
        assert headers.get("trace_id") == (r["trace"].hex() if any(r["trace"]) else None)
    # OTLP/JSON: the same request, ids in hex and enums as numbers (as the OTLP spec says)
    doc = MessageToDict(req, use_integers_for_enums=True)
    for rl in doc.get("resourceLogs", []):
        for sl in rl.get("scopeLogs", []):
            for lr in sl.get("logRecords", []):
                if "traceId" in lr:
                    import base64

                    lr["traceId"] = base64.b64decode(lr["traceId"]).hex()
    assert otlp.decode_logs_json(json.dumps(doc).encode()) == events


@given(st.binary(max_size=300))
def test_otlp_any_bytes_decode_or_raise_its_error(data: bytes) -> None:
    for decode in (otlp.decode_logs_protobuf, otlp.decode_logs_json):
        try:
            decode(data)
        except otlp.OtlpDecodeError:
            pass


@given(records, st.binary(min_size=1, max_size=20))
def test_otlp_prefixes_and_trailing_garbage_decode_or_raise_its_error(recs: list[dict[str, Any]], junk: bytes) -> None:
    data = _request(recs, {"r": "1"}).SerializeToString()
    for cut in range(len(data) + 1):  # every prefix (the bytes arriving one at a time)
        try:
            otlp.decode_logs_protobuf(data[:cut])
        except otlp.OtlpDecodeError:
            pass
    try:
        otlp.decode_logs_protobuf(data + junk)
    except otlp.OtlpDecodeError:
        pass


def test_otlp_nesting_is_bounded() -> None:
    v = common_pb2.AnyValue(string_value="x")
    for _ in range(otlp.MAX_DEPTH + 5):
        v = common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=[v]))
    req = ExportLogsServiceRequest()
    req.resource_logs.add().scope_logs.add().log_records.add().body.CopyFrom(v)
    with pytest.raises(otlp.OtlpDecodeError, match="nest deeper"):
        otlp.decode_logs_protobuf(req.SerializeToString())


# -- forward ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), text),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
entries = st.lists(st.tuples(st.integers(0, 2**32 - 1), st.dictionaries(text, json_values, max_size=3)), max_size=4)


def _modes(tag: str, es: list[tuple[int, dict[str, Any]]]) -> list[bytes]:
    packed = b"".join(msgpack.packb([t, r]) for t, r in es)
    out = [msgpack.packb([tag, [[t, r] for t, r in es]]), msgpack.packb([tag, packed, {"size": len(es)}])]
    out += [msgpack.packb([tag, t, r]) for t, r in es]
    return out


def _events(data: bytes, step: int | None = None) -> list[tuple[bytes, dict[str, str]]]:
    d = ForwardDecoder(1 << 20)
    out = []
    chunks = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    for c in chunks:
        d.feed(c)
        for m in d.messages():
            out += [entry_event(m.tag, e) for e in m.entries]
    return out


@given(text, entries)
def test_forward_whole_and_one_byte_at_a_time_give_the_same_events(tag: str, es: list[Any]) -> None:
    data = b"".join(_modes(tag, es))
    whole = _events(data)
    assert _events(data, 1) == whole
    assert len(whole) == 3 * len(es)
    for i, (t, r) in enumerate(es):
        body, headers = whole[i]
        assert json.loads(body) == r
        assert headers == {"tag": tag, "timestamp": str(t)}


@given(text, entries, st.binary(min_size=1, max_size=30))
def test_forward_trailing_garbage_gives_events_or_its_error(tag: str, es: list[Any], junk: bytes) -> None:
    data = b"".join(_modes(tag, es))
    try:
        got = _events(data + junk)
    except ForwardError:
        return
    assert got[: 3 * len(es)] == _events(data)


@given(st.binary(max_size=300))
def test_forward_any_bytes_decode_or_raise_its_error(data: bytes) -> None:
    try:
        _events(data)
    except ForwardError:
        pass


def test_forward_a_message_over_the_limit_is_refused_while_it_arrives() -> None:
    d = ForwardDecoder(1024)
    d.feed(b"\x93\xa1t\x01\xdb\x40\x00\x00\x00")  # a record declared as a 1 GiB string
    for _ in range(5):  # 1009 bytes held
        d.feed(b"x" * 200)
        assert d.messages() == []
    with pytest.raises(ForwardError, match="over 1024 bytes"):
        d.feed(b"x" * 200)


def test_forward_packed_entries_sent_as_str_and_values_that_are_not_utf8() -> None:
    """Old Fluentd sends PackedForward entries as a msgpack str; records may hold bytes that are not UTF-8."""
    entry = msgpack.packb([7, {"ok": "é", "bad": b"\xff"}])
    raw_str = b"\xdb" + len(entry).to_bytes(4, "big") + entry  # str 32 holding the packed entries
    data = b"\x92\xa1t" + raw_str
    data += b"\x93\xa1t\x08\x81\xa1k\xa1\xfe"  # ["t", 8, {"k": a one-byte str that is not UTF-8}]
    events = _events(data)
    assert events[0] == (b'{"ok":"\xc3\xa9","bad":{"$binary":"/w=="}}', {"tag": "t", "timestamp": "7"})
    assert json.loads(events[1][0]) == {"k": {"$binary": "/g=="}}
    with pytest.raises(ForwardError, match="tag is not UTF-8"):
        _events(b"\x93\xa1\xfe\x01\x80")


@given(st.binary(max_size=50), st.dictionaries(text, text, max_size=4))
def test_encoded_event_size_is_the_encoded_length(body: bytes, headers: dict[str, str]) -> None:
    from filechannel.format import encode_event, encoded_event_size

    assert encoded_event_size(body, headers) == len(encode_event(body, headers))
