"""The sans-I/O syslog and RELP core (``filechannel/agent/syslog_wire.py``): framing, parsing, bounds.

Every framing case runs three ways, as h11's tests do: the bytes whole, one
byte at a time, and split at random points; a trailing partial frame
(garbage) never changes the frames before it. Any bytes at all give frames
or :class:`RelpProtocolError`, never another exception, and the buffers stay
bounded by one frame.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from filechannel.agent.syslog_wire import (
    MAX_COUNT_DIGITS,
    Frame,
    RelpFrame,
    RelpParser,
    RelpProtocolError,
    SyslogFramer,
    TooLarge,
    parse_syslog,
    relp_frame,
)

MAX = 64


def feed_ways(make: Callable[[], Any], data: bytes, splits: list[int]) -> list[list[Any]]:
    """The parser's output for ``data`` fed whole, byte by byte, and cut at ``splits``."""
    outs = []
    p = make()
    outs.append(p.feed(data))
    p = make()
    outs.append([x for i in range(len(data)) for x in p.feed(data[i : i + 1])])
    p = make()
    cuts = sorted({0, len(data), *(s % (len(data) + 1) for s in splits)})
    outs.append([x for a, b in itertools.pairwise(cuts) for x in p.feed(data[a:b])])
    return outs


messages = st.lists(st.binary(min_size=1, max_size=MAX + 20), min_size=1, max_size=8)
splits = st.lists(st.integers(0, 2000), max_size=6)


def expected(msgs: list[bytes]) -> list[Frame | TooLarge]:
    return [Frame(m) if len(m) <= MAX else TooLarge(len(m)) for m in msgs]


@given(messages, splits, st.binary(max_size=30))
def test_octet_counting_whole_bytewise_and_split(msgs: list[bytes], cuts: list[int], garbage: bytes) -> None:
    data = b"".join(b"%d %s" % (len(m), m) for m in msgs)
    for out in feed_ways(lambda: SyslogFramer(MAX), data, cuts):
        assert out == expected(msgs)
    # trailing garbage: a partial frame after them changes nothing before it
    f = SyslogFramer(MAX)
    assert f.feed(data + b"%d " % (len(garbage) + 1) + garbage) == expected(msgs)
    assert f.buffered <= MAX + MAX_COUNT_DIGITS


@given(
    st.lists(st.binary(min_size=1, max_size=MAX + 20).filter(lambda m: b"\n" not in m), min_size=1, max_size=8),
    splits,
)
def test_lf_framing_whole_bytewise_and_split(msgs: list[bytes], cuts: list[int]) -> None:
    msgs = [b"<" + m for m in msgs]  # not a digit first: LF framing
    data = b"".join(m + b"\n" for m in msgs)
    for out in feed_ways(lambda: SyslogFramer(MAX), data, cuts):
        assert out == expected(msgs)
    f = SyslogFramer(MAX)
    assert f.feed(data + b"<partial") == expected(msgs)
    assert f.end() == [Frame(b"<partial")]


def test_framing_is_chosen_per_connection_by_its_first_byte() -> None:
    f = SyslogFramer(MAX)
    assert f.feed(b"5 <1>ab") == [Frame(b"<1>ab")]
    assert f.octet_counting
    f = SyslogFramer(MAX)
    assert f.feed(b"<1>a\n5 <1>ab\n") == [Frame(b"<1>a"), Frame(b"5 <1>ab")]
    assert f.octet_counting is False


def test_a_long_lf_frame_is_skipped_and_the_stream_goes_on_with_bounded_memory() -> None:
    f = SyslogFramer(MAX)
    out = []
    out += f.feed(b"<1>ok\n<1>" + b"x" * 50)
    for _ in range(100):
        out += f.feed(b"y" * 1000)
        assert f.buffered <= MAX
    out += f.feed(b"z\n<1>next\n")
    assert out == [Frame(b"<1>ok"), TooLarge(3 + 50 + 100_000 + 1), Frame(b"<1>next")]


def test_a_count_that_is_not_a_number_keeps_the_line_as_a_broken_frame() -> None:
    f = SyslogFramer(MAX)
    assert f.feed(b"3 abcx9 junk\n4 efgh") == [Frame(b"abc"), Frame(b"x9 junk", broken=True), Frame(b"efgh")]
    assert f.feed(b"12") == []
    assert f.end() == [Frame(b"12", broken=True)]


def test_a_huge_count_is_skipped_without_buffering() -> None:
    f = SyslogFramer(MAX)
    assert f.feed(b"1000000 " + b"a" * 500_000) == [TooLarge(1_000_000)]
    assert f.buffered == 0
    assert f.feed(b"a" * 500_000 + b"2 ok") == [Frame(b"ok")]
    f = SyslogFramer(MAX)
    assert f.feed(b"99999999999 x\n") == [Frame(b"99999999999 x", broken=True)]  # 11 digits: not a count


@settings(max_examples=300)
@given(st.binary(max_size=400), splits)
def test_any_bytes_frame_without_error_and_within_bounds(data: bytes, cuts: list[int]) -> None:
    outs = feed_ways(lambda: SyslogFramer(MAX), data, cuts)
    assert outs[0] == outs[1] == outs[2]
    f = SyslogFramer(MAX)
    for i in range(len(data)):
        f.feed(data[i : i + 1])
        assert f.buffered <= MAX + MAX_COUNT_DIGITS + 1
    for fr in outs[0]:
        assert isinstance(fr, (Frame, TooLarge))
        if isinstance(fr, Frame):
            assert len(fr.data) <= MAX + MAX_COUNT_DIGITS + 1


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_parse_syslog_never_raises_and_invalid_keeps_the_exact_bytes(data: bytes) -> None:
    body, headers = parse_syslog(data)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
    if headers.get("syslog.status") == "invalid":
        assert body == data
        assert headers == {"syslog.status": "invalid"}
    else:
        assert 0 <= int(headers["facility"]) <= 23
        assert 0 <= int(headers["severity"]) <= 7


@pytest.mark.parametrize(
    ("frame", "body", "headers"),
    [
        (
            b'<165>1 2003-10-11T22:14:15.003Z mymachine.example.com evntslog - ID47 [exampleSDID@32473 iut="3" '
            b'eventSource="Application" eventID="1011"] \xef\xbb\xbfAn application event log entry...',
            b"An application event log entry...",
            {
                "facility": "20",
                "severity": "5",
                "timestamp": "2003-10-11T22:14:15.003Z",
                "hostname": "mymachine.example.com",
                "appname": "evntslog",
                "msgid": "ID47",
                "structured_data": '[exampleSDID@32473 iut="3" eventSource="Application" eventID="1011"]',
            },
        ),
        (b"<13>1 - - - - - -", b"", {"facility": "1", "severity": "5"}),
        (
            b'<13>1 - h a 7 - [a@1 x="q\\"\\]"][b@2] m\n',
            b"m",
            {"facility": "1", "severity": "5", "hostname": "h", "appname": "a", "procid": "7"}
            | {"structured_data": '[a@1 x="q\\"\\]"][b@2]'},
        ),
        (
            b"<34>Oct 11 22:14:15 mymachine su: 'su root' failed for lonvick on /dev/pts/8",
            b"'su root' failed for lonvick on /dev/pts/8",
            {"facility": "4", "severity": "2", "timestamp": "Oct 11 22:14:15", "hostname": "mymachine"}
            | {"appname": "su"},
        ),
        (
            b"<13>Nov  2 01:02:03 cron[77]: job",
            b"job",
            {"facility": "1", "severity": "5", "timestamp": "Nov  2 01:02:03", "appname": "cron", "procid": "77"},
        ),
        (b"<0>no timestamp at all", b"no timestamp at all", {"facility": "0", "severity": "0"}),
    ],
)
def test_rfc5424_and_rfc3164_examples(frame: bytes, body: bytes, headers: dict[str, str]) -> None:
    assert parse_syslog(frame) == (body, headers)


@pytest.mark.parametrize(
    "frame",
    [
        b"no pri",
        b"<192>1 - - - - - -",
        b"<013>x",
        b"<13>1 - - - - -",
        b"<13>1 - - - - - [unterminated",
        b"<13>1 - - - - - -x",
        b'<13>1 - - - - - [a@1 x="\xff"] m',
        b"",
    ],
)
def test_unparsable_frames_are_kept_whole_as_invalid(frame: bytes) -> None:
    assert parse_syslog(frame) == (frame, {"syslog.status": "invalid"})


# -- RELP -------------------------------------------------------------------------------------------

relp_frames = st.lists(
    st.tuples(st.integers(0, 999_999_999), st.sampled_from(["open", "syslog", "close", "rsp"]), st.binary(max_size=90)),
    min_size=1,
    max_size=6,
)


@given(relp_frames, splits)
def test_relp_frames_whole_bytewise_and_split(frames: list[tuple[int, str, bytes]], cuts: list[int]) -> None:
    data = b"".join(relp_frame(*f) for f in frames)
    want = [RelpFrame(t, c, d) if len(d) <= MAX else RelpFrame(t, c, None, too_large=len(d)) for t, c, d in frames]
    for out in feed_ways(lambda: RelpParser(MAX), data, cuts):
        assert out == want
    p = RelpParser(MAX)
    assert p.feed(data + b"7 syslog 10 abc") == want  # a partial frame after them


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_any_bytes_give_relp_frames_or_a_protocol_error(data: bytes) -> None:
    p = RelpParser(MAX)
    try:
        for i in range(len(data)):
            p.feed(data[i : i + 1])
            assert p.buffered <= MAX + 33
    except RelpProtocolError:
        with pytest.raises(RelpProtocolError):
            p.feed(b"1 close 0\n")  # the session cannot be resynchronised


@pytest.mark.parametrize(
    "data", [b"x open 0\n", b"1 op3n 0\n", b"1 open -1\n", b"1 open 3 abcX", b"1 open 3\n", b"1234567890 open 0\n"]
)
def test_relp_grammar_errors(data: bytes) -> None:
    with pytest.raises(RelpProtocolError):
        RelpParser(MAX).feed(data)


def test_relp_frames_without_data_with_and_without_a_space() -> None:
    assert RelpParser(MAX).feed(b"1 close 0\n2 close 0 \n") == [RelpFrame(1, "close", b""), RelpFrame(2, "close", b"")]
    assert relp_frame(3, "rsp", b"200 OK") == b"3 rsp 6 200 OK\n"
    assert relp_frame(0, "serverclose") == b"0 serverclose 0\n"


token = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20).filter(
    lambda t: t != "-"
)
field = st.one_of(st.just("-"), token)
sd_name = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=' ="]'), min_size=1, max_size=8
)
sd_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF), max_size=10).map(
    lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("]", "\\]")
)
sd_element = st.tuples(sd_name, st.lists(st.tuples(sd_name, sd_value), max_size=3)).map(
    lambda e: "[" + e[0] + "".join(f' {k}="{v}"' for k, v in e[1]) + "]"
)


@settings(max_examples=300)
@given(
    st.integers(0, 191),
    st.lists(field, min_size=5, max_size=5),
    st.one_of(st.just("-"), st.lists(sd_element, min_size=1, max_size=3).map("".join)),
    st.one_of(st.none(), st.binary(max_size=40).filter(lambda m: not m.endswith(b"\n"))),
)
def test_rfc5424_messages_parse_back_to_their_fields(pri: int, fields: list[str], sd: str, msg: bytes | None) -> None:
    frame = f"<{pri}>1 {' '.join(fields)} {sd}".encode() + (b"" if msg is None else b" " + msg)
    body, headers = parse_syslog(frame)
    want = {"facility": str(pri >> 3), "severity": str(pri & 7)}
    for name, value in zip(("timestamp", "hostname", "appname", "procid", "msgid"), fields, strict=True):
        if value != "-":
            want[name] = value
    if sd != "-":
        want["structured_data"] = sd
    assert headers == want
    expect = msg or b""
    assert body == (expect[3:] if expect.startswith(b"\xef\xbb\xbf") else expect)
