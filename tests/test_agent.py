"""The agent (filechannel.agent) in process: ranges, acks, identities, refusals, TLS, tokens, deadlines, encryption."""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow.flight")
pytest.importorskip("cryptography")

from helpers import put_records
from test_encryption import write_keystore

import filechannel
from filechannel import format as fmt
from filechannel.agent import (
    AgentAuthError,
    AgentSettings,
    AgentTimeoutError,
    AgentUnavailableError,
    RawSegment,
    UnknownChannelError,
    connect,
    serve,
)
from filechannel.reader import ChannelReader, decode_segment, read_segment
from filechannel.testing.pki import PKI, write_file

K1 = bytes(range(32))

# -- helpers (also used by test_agent_process.py) --------------------------------------------------


_write = write_file  # test_agent_http and test_agent_metrics import it by this name


def make_channel(d: Path, n: int, *, per_txn: int = 10, **options: Any) -> str:
    """A channel at ``d`` holding events ``b"ev-0" .. b"ev-{n-1}"`` (header ``i``), closed."""
    ch = filechannel.open(str(d), minimum_required_space=0, **options)
    i = 0
    while i < n:
        with ch.transaction() as tx:
            for _ in range(min(per_txn, n - i)):
                tx.put(b"ev-%d" % i, headers={"i": str(i)})
                i += 1
    ch.close()
    return str(d)


def bodies(events: list[filechannel.Event]) -> list[bytes]:
    return [e.body for e in events]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pki")
    ca = PKI(root / "ca")
    other = PKI(root / "other", "other-ca")
    return {
        "ca": ca.ca,
        "server": ca.issue("agent", server=True),
        "client": ca.issue("spark-exec"),
        "client2": ca.issue("intruder"),
        "foreign": other.issue("spark-exec"),
        "other_ca": other.ca,
    }


@pytest.fixture
def chan(tmp_path: Path) -> str:
    return make_channel(tmp_path / "c1", 100)


@pytest.fixture
def agent(chan: str) -> Iterator[Any]:
    a = serve([chan], "grpc://127.0.0.1:0")
    yield a
    a.stop()


def drain(d: str) -> list[tuple[bytes, dict[str, str]]]:
    """Every queued event of the channel in ``d`` (bodies and headers), taken and rolled back."""
    with filechannel.open(d, minimum_required_space=0) as ch:
        tx = ch.transaction()
        out = [(e.body, dict(e.headers)) for e in tx.take_batch(10_000)]
        tx.rollback()
        return out


def mtls_agent(pki: dict[str, Any], dirs: list[str], **options: Any) -> Any:
    """An agent on ``grpc+tls`` with the test PKI's server certificate, requiring client certificates."""
    cert, key = pki["server"]
    return serve(dirs, "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key, client_ca=pki["ca"], **options)


def mtls_client(pki: dict[str, Any], agent: Any, who: str = "client") -> Any:
    """A client of ``agent`` with the test PKI's ``who`` certificate ("client": spark-exec; "client2": intruder)."""
    uri = f"grpc+tls://localhost:{agent.port}"
    return connect(uri, tls_ca=pki["ca"], tls_cert=pki[who][0], tls_key=pki[who][1], timeout=5)


def assert_not_consumer(client: Any, peer: str, cid: str, consumer: str, identity: str, ack: int) -> None:
    """Each consumer call of ``client`` (certificate name ``peer``) as ``consumer`` is refused, a takeover too."""
    for call in (
        lambda: client.register(cid, consumer, "id-takeover", reset=True),
        lambda: client.ack(cid, consumer, ack, identity),
        lambda: client.available(cid, consumer, identity),
    ):
        with pytest.raises(AgentAuthError, match=f"'{peer}' may not act as consumer '{consumer}'"):
            call()


def cid_of(path: str) -> str:
    return filechannel.reader.channel_id_of(path).hex()


# -- ranges ----------------------------------------------------------------------------------------


def test_discovery_names_each_channel_by_id_with_its_visible_end(tmp_path: Path) -> None:
    a_dir = make_channel(tmp_path / "a", 30)
    b_dir = make_channel(tmp_path / "b", 7)
    with serve([a_dir, b_dir], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=5) as c:
        chans = c.channels()
        assert set(chans) == {cid_of(a_dir), cid_of(b_dir)}
        assert (chans[cid_of(a_dir)].name, chans[cid_of(a_dir)].start, chans[cid_of(a_dir)].end) == ("a", 0, 30)
        assert chans[cid_of(b_dir)].end == 7
        # The visible end follows the owner's commits.
        ch = filechannel.open(b_dir, minimum_required_space=0)
        with ch.transaction() as tx:
            tx.put(b"late")
        ch.close()
        assert c.channels()[cid_of(b_dir)].end == 8


def test_a_range_reads_the_same_events_as_a_local_read(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    with connect(agent.location, timeout=5) as c:
        for start, end in [(0, 100), (0, 1), (13, 57), (99, 100), (40, 40)]:
            got = c.read(cid, start, end)
            with ChannelReader(chan) as view:
                want = view.read(start, end)
            assert got == want
            assert [e.position for e in got] == list(range(start, end))
        # Small segments: many record batches, same events.
        raw = c.read_raw(cid, 0, 100, max_bytes=200)
        assert len(raw) > 5
        assert [e for s in raw for e in s.events()] == c.read(cid, 0, 100)


def test_decode_segment_is_read_segment_on_the_same_bytes(chan: str) -> None:
    with ChannelReader(chan) as view:
        segs = view.segments(0, 100, 300)
    for s in segs:
        with open(s.path, "rb") as fh:
            fh.seek(s.offset)
            data = fh.read(s.length)
        assert decode_segment(s, data) == read_segment(s)
        with pytest.raises(filechannel.CorruptLogError, match="received"):
            decode_segment(s, data[:-1])


def test_a_range_beyond_what_the_channel_holds_is_refused(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    with connect(agent.location, timeout=5) as c:
        with pytest.raises(filechannel.DataLossError, match=r"below 100 only.*at agent grpc://127\.0\.0\.1") as ei:
            c.read(cid, 90, 101)
        assert (ei.value.start, ei.value.end) == (100, 101)


def test_a_range_already_taken_is_refused(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 20)
    ch = filechannel.open(d, minimum_required_space=0)
    with ch.transaction() as tx:
        tx.take_batch(5)
    ch.close()
    with serve([d], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=5) as c:
        assert c.available(cid_of(d)) == (5, 20)
        with pytest.raises(filechannel.DataLossError, match="already taken"):
            c.read(cid_of(d), 0, 10)
        assert bodies(c.read(cid_of(d), 5, 7)) == [b"ev-5", b"ev-6"]


def test_an_unknown_channel_is_refused_naming_what_is_served(agent: Any, chan: str) -> None:
    with connect(agent.location, timeout=5) as c:
        with pytest.raises(UnknownChannelError, match=cid_of(chan)) as ei:
            c.read("ab" * 16, 0, 1)
        assert ei.value.channel == "ab" * 16
        with pytest.raises(UnknownChannelError):
            c.register("ab" * 16, "q", "id")


def test_two_directories_of_one_channel_are_refused(tmp_path: Path) -> None:
    import shutil

    d = make_channel(tmp_path / "a", 3)
    shutil.copytree(d, tmp_path / "copy")
    with pytest.raises(filechannel.ConfigError, match="same channel"):
        serve([d, str(tmp_path / "copy")], "grpc://127.0.0.1:0")


# -- consumers and acks ------------------------------------------------------------------------------


def test_acks_are_durable_cumulative_and_idempotent(chan: str) -> None:
    cid = cid_of(chan)
    agent = serve([chan], "grpc://127.0.0.1:0")
    try:
        c = connect(agent.location, timeout=5)
        assert c.register(cid, "q", "query-1") == 0
        assert c.available(cid, "q", "query-1") == (0, 100)
        assert c.ack(cid, "q", 30, "query-1") == 30
        assert c.ack(cid, "q", 10, "query-1") == 30  # cumulative: a lower end changes nothing
        assert c.ack(cid, "q", 30, "query-1") == 30  # idempotent
        assert c.available(cid, "q", "query-1") == (30, 100)
        st = c.status()
        row = st["channels"][0]["consumers"]["q"]
        assert row.pop("lag_bytes") > 0  # the bytes of those 70 events (filechannel top shows them)
        assert row == {"identity": "query-1", "acked": 30, "lag": 70}
    finally:
        agent.stop()
    # On disk, through the channel's own registry: the owner sees the ack.
    assert filechannel.consumers.ConsumerStore(filechannel._fs.DEFAULT_FS, chan).get("q").acked == 30
    # A new agent (a restart) sees it too.
    with serve([chan], "grpc://127.0.0.1:0") as again, connect(again.location, timeout=5) as c2:
        assert c2.register(cid, "q", "query-1") == 30
        assert c2.available(cid, "q", "query-1") == (30, 100)


def test_an_ack_beyond_the_visible_end_is_refused(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    with connect(agent.location, timeout=5) as c:
        c.register(cid, "q", "id")
        with pytest.raises(filechannel.DataLossError, match="below 100 only"):
            c.ack(cid, "q", 101, "id")
        assert c.available(cid, "q", "id") == (0, 100)


def test_identities_protect_a_consumer_name(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    with connect(agent.location, timeout=5) as c:
        c.register(cid, "q", "query-1")
        c.ack(cid, "q", 40, "query-1")
        with pytest.raises(filechannel.ConsumerIdentityError) as ei:
            c.register(cid, "q", "query-2")
        assert (ei.value.recorded, ei.value.given) == ("query-1", "query-2")
        with pytest.raises(filechannel.ConsumerIdentityError):
            c.available(cid, "q", "query-2")
        with pytest.raises(filechannel.ConsumerIdentityError):
            c.ack(cid, "q", 50, "query-2")
        # A takeover with reset keeps the mark; the old identity is refused from then on.
        assert c.register(cid, "q", "query-2", reset=True) == 40
        with pytest.raises(filechannel.ConsumerIdentityError):
            c.ack(cid, "q", 60, "query-1")
        with pytest.raises(filechannel.ConsumerIdentityError):
            c.available(cid, "q", "query-1")
        assert c.ack(cid, "q", 60, "query-2") == 60


def test_a_bad_consumer_name_is_a_config_error(agent: Any, chan: str) -> None:
    with connect(agent.location, timeout=5) as c, pytest.raises(filechannel.ConfigError, match="consumer"):
        c.register(cid_of(chan), "no spaces", "id")


# -- settings ----------------------------------------------------------------------------------------


def test_settings_pickle_without_secrets(pki: dict[str, Any], tmp_path: Path) -> None:
    token = _write(tmp_path / "token", b"TOKEN-SECRET-123\n", 0o600)
    cert, key = pki["client"]
    s = AgentSettings("grpc+tls://localhost:1", tls_ca=pki["ca"], tls_cert=cert, tls_key=key, token_file=token)
    c = s.connect()
    blob = pickle.dumps(c)
    assert b"TOKEN-SECRET" not in blob
    assert b"PRIVATE KEY" not in blob
    assert pickle.loads(blob).settings == s


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("grpc://10.1.2.3:8815", "loopback address only"),
        ("grpc://0.0.0.0:8815", "loopback address only"),
        ("http://127.0.0.1:1", "scheme"),
        ("grpc+tls://host", "HOST:PORT"),
        ("grpc+unix://relative.sock", "absolute"),
    ],
)
def test_bad_uris_are_refused_on_both_ends(uri: str, match: str, chan: str) -> None:
    with pytest.raises(filechannel.ConfigError, match=match):
        serve([chan], uri)
    with pytest.raises(filechannel.ConfigError, match=match):
        connect(uri)


def test_tls_without_a_certificate_is_refused(chan: str) -> None:
    with pytest.raises(filechannel.ConfigError, match="--tls-cert FILE and --tls-key FILE"):
        serve([chan], "grpc+tls://127.0.0.1:0")


def test_a_token_file_others_can_read_is_refused(chan: str, tmp_path: Path) -> None:
    token = _write(tmp_path / "token", b"s3cret\n", 0o644)
    with pytest.raises(filechannel.ConfigError, match="chmod 600") as ei:
        serve([chan], "grpc://127.0.0.1:0", token_file=token)
    assert "s3cret" not in str(ei.value)
    with pytest.raises(filechannel.ConfigError, match="chmod 600"):
        connect("grpc://127.0.0.1:1", token_file=token)


# -- security ----------------------------------------------------------------------------------------


def test_bearer_token_missing_or_wrong_is_refused(chan: str, tmp_path: Path) -> None:
    good = _write(tmp_path / "good", b"right-token\n", 0o600)
    bad = _write(tmp_path / "bad", b"wrong-token\n", 0o600)
    with serve([chan], "grpc://127.0.0.1:0", token_file=good) as agent:
        with pytest.raises(AgentAuthError, match="requires a bearer token"):
            connect(agent.location, timeout=5).channels()
        with pytest.raises(AgentAuthError, match="token is wrong"):
            connect(agent.location, timeout=5, token_file=bad).read(cid_of(chan), 0, 1)
        assert bodies(connect(agent.location, timeout=5, token_file=good).read(cid_of(chan), 0, 2)) == [
            b"ev-0",
            b"ev-1",
        ]


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(pki: dict[str, Any], chan: str) -> None:
    cert, key = pki["server"]
    with serve([chan], "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key, client_ca=pki["ca"]) as agent:
        uri = f"grpc+tls://localhost:{agent.port}"
        with pytest.raises(AgentUnavailableError, match="give tls_cert and tls_key"):
            connect(uri, tls_ca=pki["ca"], timeout=5).channels()
        fcert, fkey = pki["foreign"]  # same name, another CA
        with pytest.raises(AgentUnavailableError, match=r"does not accept this client's certificate \(tls_cert "):
            connect(uri, tls_ca=pki["ca"], tls_cert=fcert, tls_key=fkey, timeout=5).channels()
        ccert, ckey = pki["client"]
        ok = connect(uri, tls_ca=pki["ca"], tls_cert=ccert, tls_key=ckey, timeout=5)
        assert list(ok.channels()) == [cid_of(chan)]
        assert bodies(ok.read(cid_of(chan), 3, 5)) == [b"ev-3", b"ev-4"]


def test_a_client_that_does_not_trust_the_agent_is_refused(pki: dict[str, Any], chan: str) -> None:
    cert, key = pki["server"]
    with serve([chan], "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key) as agent:
        with pytest.raises(AgentUnavailableError, match=r"does not trust the agent's certificate.*no tls_ca was given"):
            connect(f"grpc+tls://localhost:{agent.port}", timeout=5).channels()  # the system roots
        with pytest.raises(AgentUnavailableError, match=f"not signed by the CA in tls_ca \\({pki['other_ca']}\\)"):
            connect(f"grpc+tls://localhost:{agent.port}", tls_ca=pki["other_ca"], timeout=5).channels()
        ok = connect(f"grpc+tls://localhost:{agent.port}", tls_ca=pki["ca"], timeout=5)
        assert list(ok.channels()) == [cid_of(chan)]


def test_a_tls_client_to_a_plain_agent_is_told_so(pki: dict[str, Any], chan: str) -> None:
    with (
        serve([chan], "grpc://127.0.0.1:0") as agent,
        pytest.raises(AgentUnavailableError, match="does not speak TLS at this address"),
    ):
        connect(f"grpc+tls://localhost:{agent.port}", tls_ca=pki["ca"], timeout=5).channels()


_CLIENT_CHILD = """
import logging, sys
from filechannel.agent import connect
if sys.argv[2] == "info":
    logging.getLogger("filechannel").setLevel(logging.INFO)
try:
    connect(sys.argv[1], timeout=5).channels()
except Exception as exc:
    print(type(exc).__name__)
"""


@pytest.mark.parametrize(
    ("env", "level", "grpc_lines"),
    [({}, "warning", False), ({"GRPC_VERBOSITY": "INFO"}, "warning", True), ({}, "info", True)],
)
def test_grpc_logs_nothing_in_a_client_unless_asked(
    pki: dict[str, Any], chan: str, env: dict[str, str], level: str, grpc_lines: bool
) -> None:
    import subprocess
    import sys

    cert, key = pki["server"]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    child_env.update(env)
    with serve([chan], "grpc+tls://127.0.0.1:0", tls_cert=cert, tls_key=key) as agent:
        uri = f"grpc+tls://localhost:{agent.port}"  # no tls_ca: the handshake fails at the client
        r = subprocess.run(
            [sys.executable, "-c", _CLIENT_CHILD, uri, level], capture_output=True, text=True, timeout=60, env=child_env
        )
    assert r.stdout.strip() == "AgentUnavailableError", r.stderr
    shown = "Handshake failed" in r.stderr or "absl::InitializeLog" in r.stderr
    assert shown == grpc_lines, r.stderr


def test_the_allow_list_narrows_channels_by_certificate_name(pki: dict[str, Any], tmp_path: Path) -> None:
    a_dir = make_channel(tmp_path / "a", 5)
    b_dir = make_channel(tmp_path / "b", 5)
    a, b = cid_of(a_dir), cid_of(b_dir)
    with mtls_agent(pki, [a_dir, b_dir], allow={a: ["spark-exec", "intruder"], b: ["spark-exec"]}) as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        assert set(good.channels()) == {a, b}
        assert set(other.channels()) == {a}
        assert len(other.read(a, 0, 5)) == 5
        with pytest.raises(AgentAuthError, match="'intruder' is not allowed to use channel"):
            other.read(b, 0, 1)
        with pytest.raises(AgentAuthError, match="not allowed"):
            other.register(b, "q", "id")
        assert [c["channel"] for c in other.status()["channels"]] == [a]


def test_an_allow_list_needs_client_certificates(chan: str) -> None:
    with pytest.raises(filechannel.ConfigError, match="client-ca"):
        serve([chan], "grpc://127.0.0.1:0", allow={"*": ["x"]})
    with pytest.raises(filechannel.ConfigError, match="client-ca"):
        serve([chan], "grpc://127.0.0.1:0", consumers={"x": ["q"]})


def test_a_certificate_name_acts_only_as_the_consumers_it_is_allowed(pki: dict[str, Any], chan: str) -> None:
    cid = cid_of(chan)
    with mtls_agent(pki, [chan], consumers={"intruder": ["q-intruder"]}) as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        # "spark-exec" is not listed: any consumer no listed name owns.
        good.register(cid, "q", "id-good")
        assert good.ack(cid, "q", 3, "id-good") == 3
        # "intruder" may read the channel and act as its own consumer, but not as another query's,
        # even with resetConsumer (which would take the name over and acknowledge for it).
        assert len(other.read(cid, 0, 5)) == 5
        other.register(cid, "q-intruder", "id-other")
        assert other.ack(cid, "q-intruder", 2, "id-other") == 2
        assert_not_consumer(other, "intruder", cid, "q", "id-good", ack=10)
        assert good.available(cid, "q", "id-good")[0] == 3  # untouched


def test_only_the_allowed_writers_put_or_stage(pki: dict[str, Any], chan: str) -> None:
    cid = cid_of(chan)
    with mtls_agent(pki, [chan], writers={"spark-exec"}, writable=True) as agent:
        good, other = mtls_client(pki, agent), mtls_client(pki, agent, "client2")
        before = agent.channels[cid].channel.size
        assert not good.put_batch(cid, [b"w-1"], producer="p", sequence=1).duplicate
        with pytest.raises(AgentAuthError, match="'intruder' may not write to channel"):
            other.put_batch(cid, [b"w-2"], producer="x", sequence=1)
        with pytest.raises(AgentAuthError, match="'intruder' may not write to channel"):
            other.sink_stage(cid, [(b"row", None)], partition=0, attempt=0, query="q1", batch_id=0)
        with pytest.raises(AgentAuthError, match="'intruder' may not write to channel"):
            other.sink_commit(cid, [], query="q1", batch_id=0)
        assert agent.channels[cid].channel.size == before + 1
        assert len(other.read(cid, 0, 2)) == 2  # reading is still allowed


def test_allow_consumer_names_are_checked(pki: dict[str, Any], chan: str) -> None:
    with pytest.raises(filechannel.ConfigError, match=r"consumers.*may only hold"):
        mtls_agent(pki, [chan], consumers={"x": ["no spaces"]})


# -- deadlines and a stopped agent ---------------------------------------------------------------------


def test_a_stalled_agent_fails_the_call_within_its_deadline(agent: Any, chan: str) -> None:
    ch = agent.channels[cid_of(chan)]
    c = connect(agent.location, timeout=0.5)
    assert c.available(cid_of(chan)) == (0, 100)
    ch.lock.acquire()  # every handler of this channel now waits
    try:
        for call in (lambda: c.available(cid_of(chan)), lambda: c.read(cid_of(chan), 0, 10)):
            t0 = time.monotonic()
            with pytest.raises(AgentTimeoutError, match="deadline"):
                call()
            assert time.monotonic() - t0 < 3.0
    finally:
        ch.lock.release()
    assert c.available(cid_of(chan)) == (0, 100)


def test_a_stopped_agent_is_seen_at_once(chan: str) -> None:
    agent = serve([chan], "grpc://127.0.0.1:0")
    c = connect(agent.location, timeout=30)
    assert c.available(cid_of(chan)) == (0, 100)
    agent.stop()
    t0 = time.monotonic()
    with pytest.raises(AgentUnavailableError, match="cannot reach the agent") as ei:
        c.available(cid_of(chan))
    assert not isinstance(ei.value, AgentTimeoutError)
    assert time.monotonic() - t0 < 5.0
    assert isinstance(ei.value, filechannel.ChannelError)


def test_a_unix_socket_agent(chan: str, tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    with serve([chan], f"grpc+unix://{sock}") as agent, connect(agent.location, timeout=5) as c:
        assert agent.port == 0
        assert bodies(c.read(cid_of(chan), 0, 1)) == [b"ev-0"]


# -- end-to-end checks: damage and encryption ------------------------------------------------------------


def flip_payload_byte(d: str, position: int) -> None:
    """Flip a bit of the first payload byte of the put at ``position``, leaving its record checksum as it was."""
    path, _fid, rec, _seed = put_records(d)[position]
    with open(path, "r+b") as fh:
        fh.seek(rec.offset + fmt.RECORD_HEADER_LEN)
        b = fh.read(1)
        fh.seek(rec.offset + fmt.RECORD_HEADER_LEN)
        fh.write(bytes([b[0] ^ 0x01]))


def forge_sealed_byte(d: str, position: int) -> None:
    """Edit a sealed payload byte of the put at ``position`` and repair its record checksum: only the tag can tell."""
    from filechannel.directory import CHANNEL_FILE, decode_channel_file

    kind = decode_channel_file(Path(d, CHANNEL_FILE).read_bytes())[1]
    path, _fid, rec, seed = put_records(d)[position]
    with open(path, "r+b") as fh:
        fh.seek(rec.offset)
        frame = bytearray(fh.read(rec.size))
        frame[fmt.RECORD_HEADER_LEN + 5] ^= 0x01
        n = len(rec.payload)
        payload = bytes(frame[fmt.RECORD_HEADER_LEN : fmt.RECORD_HEADER_LEN + n])
        crc = fmt.crc(kind, payload, fmt.crc(kind, bytes(frame[:24]), seed))
        struct.pack_into("<II", frame, 24, crc, 0)
        fh.seek(rec.offset)
        fh.write(frame)


def test_an_edited_byte_on_disk_is_caught_by_the_client(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    c = connect(agent.location, timeout=5)
    assert len(c.read(cid, 0, 100)) == 100  # the agent has indexed everything
    flip_payload_byte(chan, 42)
    with pytest.raises(filechannel.CorruptLogError, match="event at position 42: record checksum mismatch"):
        c.read(cid, 40, 45)
    assert len(c.read(cid, 43, 50)) == 7


def test_bytes_of_another_channel_do_not_pass(tmp_path: Path) -> None:
    """The checksum seed is the channel id the client asked for: an agent answering with another channel fails."""
    a_dir = make_channel(tmp_path / "a", 5)
    b_dir = make_channel(tmp_path / "b", 5)
    with serve([a_dir, b_dir], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=5) as c:
        raw = c.read_raw(cid_of(a_dir), 0, 5)
        assert bodies(raw[0].events()) == [b"ev-%d" % i for i in range(5)]
        seg = dataclasses.replace(raw[0].segment, channel_id=bytes.fromhex(cid_of(b_dir)))
        with pytest.raises(filechannel.CorruptLogError, match="checksum"):
            RawSegment(seg, raw[0].data).events()


def test_an_encrypted_channel_travels_sealed_and_decrypts_at_the_client(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d = make_channel(tmp_path / "enc", 20, encryption=filechannel.Encryption(keys=ks))
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", keystore=ks) as agent, connect(agent.location, timeout=5) as c:
        raw = c.read_raw(cid, 0, 20)
        assert all(b"ev-" not in r.data for r in raw)  # sealed on the wire
        assert all(r.segment.key_id == "k1" and r.segment.cipher for r in raw)
        with pytest.raises(filechannel.DecryptionError, match="pass encryption="):
            c.read(cid, 0, 20)
        got = c.read(cid, 0, 20, encryption=ks)
        assert bodies(got) == [b"ev-%d" % i for i in range(20)]
        assert got[3].headers == {"i": "3"}
        other = write_keystore(tmp_path / "other.json", {"k2": bytes(32)})
        with pytest.raises(filechannel.DecryptionError, match="k1"):
            c.read(cid, 0, 20, encryption=other)


def test_a_forged_record_of_an_encrypted_channel_fails_its_tag_at_the_client(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d = make_channel(tmp_path / "enc", 20, encryption=filechannel.Encryption(keys=ks))
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", keystore=ks) as agent, connect(agent.location, timeout=5) as c:
        assert len(c.read(cid, 0, 20, encryption=ks)) == 20
        forge_sealed_byte(d, 7)
        with pytest.raises(
            filechannel.DecryptionError, match="position 7: record checksum is intact but its authentication tag fails"
        ):
            c.read(cid, 5, 10, encryption=ks)


def test_an_encrypted_channel_without_the_agent_keystore_fails_at_start(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    d = make_channel(tmp_path / "enc", 3, encryption=filechannel.Encryption(keys=ks))
    with pytest.raises(filechannel.DecryptionError):
        serve([d], "grpc://127.0.0.1:0")


def test_a_takeover_made_elsewhere_is_seen_by_the_agent(agent: Any, chan: str) -> None:
    """Another process takes the consumer name over (reset): the agent's cached reader must not keep serving it."""
    cid = cid_of(chan)
    with connect(agent.location, timeout=5) as c:
        c.register(cid, "q", "query-1")
        assert c.available(cid, "q", "query-1") == (0, 100)
        with ChannelReader(chan, "q", identity="query-2", reset=True) as other:
            assert other.ack(10) == 10
        with pytest.raises(filechannel.ConsumerIdentityError) as ei:
            c.available(cid, "q", "query-1")
        assert (ei.value.recorded, ei.value.given) == ("query-2", "query-1")
        assert c.available(cid, "q", "query-2") == (10, 100)


# -- read_arrow: the raw segments decoded straight into Arrow, with read()'s checks ------------------------


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except filechannel.ChannelError as exc:
        return "raised", (type(exc), str(exc))


def assert_read_arrow_is_read(c: Any, cid: str, start: int, end: int, **kw: Any) -> tuple[str, Any]:
    """``read_arrow`` returns ``read``'s events as Arrow columns, or raises ``read``'s error (class and message)."""
    want = _outcome(lambda: [(e.position, e.body, dict(e.headers)) for e in c.read(cid, start, end, **kw)])
    got = _outcome(lambda: c.read_arrow(cid, start, end, **kw))
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        rows = got[1].to_pylist()
        assert [(r["position"], r["body"], dict(r["headers"])) for r in rows] == want[1]
    else:
        assert got[1] == want[1]
    return got


def test_read_arrow_is_read_in_arrow_columns_across_segments(tmp_path: Path) -> None:
    d = make_channel(tmp_path / "c", 300, per_txn=7, max_file_size=4096)
    with serve([d], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=5) as c:
        cid = cid_of(d)
        assert len(c.read_raw(cid, 0, 300)) > 2  # several data files, so several segments
        for a, b in ((0, 300), (17, 18), (250, 300), (5, 5)):
            got = assert_read_arrow_is_read(c, cid, a, b)
            assert got[0] == "ok"
            assert got[1].num_rows == b - a
        assert got[1].schema == filechannel.arrow.schema()
        assert_read_arrow_is_read(c, cid, 0, 301)  # past the end: read()'s error


def test_read_arrow_catches_an_edited_byte_as_read_does(agent: Any, chan: str) -> None:
    cid = cid_of(chan)
    c = connect(agent.location, timeout=5)
    assert len(c.read(cid, 0, 100)) == 100
    flip_payload_byte(chan, 42)
    got = assert_read_arrow_is_read(c, cid, 40, 45)
    assert got[0] == "raised"
    assert "event at position 42: record checksum mismatch" in got[1][1]
    assert assert_read_arrow_is_read(c, cid, 43, 50)[0] == "ok"


def test_read_arrow_of_an_encrypted_channel_needs_its_key_and_catches_a_forged_record(tmp_path: Path) -> None:
    ks = write_keystore(tmp_path / "keys.json", {"k1": K1})
    other = write_keystore(tmp_path / "other.json", {"k2": bytes(32)})
    d = make_channel(tmp_path / "enc", 20, encryption=filechannel.Encryption(keys=ks))
    cid = cid_of(d)
    with serve([d], "grpc://127.0.0.1:0", keystore=ks) as agent, connect(agent.location, timeout=5) as c:
        assert assert_read_arrow_is_read(c, cid, 0, 20)[0] == "raised"  # no key
        assert assert_read_arrow_is_read(c, cid, 0, 20, encryption=other)[0] == "raised"  # another key
        assert assert_read_arrow_is_read(c, cid, 0, 20, encryption=ks)[0] == "ok"
        forge_sealed_byte(d, 7)
        got = assert_read_arrow_is_read(c, cid, 5, 10, encryption=ks)
        assert got[0] == "raised"
        assert "authentication tag fails" in got[1][1]


def test_read_arrow_refuses_bytes_of_another_channel_and_a_short_segment(tmp_path: Path) -> None:
    """The seed is the channel id asked for, and a segment's bytes must be its length (``arrow.read_received``)."""
    from filechannel.arrow import read_received

    a_dir = make_channel(tmp_path / "a", 5)
    b_dir = make_channel(tmp_path / "b", 5)
    with serve([a_dir, b_dir], "grpc://127.0.0.1:0") as agent, connect(agent.location, timeout=5) as c:
        got = c._received(cid_of(a_dir), 0, 5, 1 << 20)
        assert read_received([(seg.run(None), raw) for seg, raw in got]).column("body").to_pylist() == [
            b"ev-%d" % i for i in range(5)
        ]
        seg, raw = got[0]
        wrong = dataclasses.replace(seg, channel_id=bytes.fromhex(cid_of(b_dir)))
        with pytest.raises(filechannel.CorruptLogError, match="checksum"):
            read_received([(wrong.run(None), raw)])
        with pytest.raises(filechannel.CorruptLogError, match=f"the segment is {len(raw)} bytes, 10 were received"):
            read_received([(seg.run(None), raw[:10])])
