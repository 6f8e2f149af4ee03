"""Event values: every Event pickles and its headers go to ``json.dumps`` (issue 23).

Events built by the caller, and Events a take returns from the cache (built in
C by ``_speedups.take_slots`` or by its twin ``channel._take_slots``) and from
disk, with and without headers, on both the accelerated and the pure path.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
from helpers import NO_ACCELERATOR

import filechannel
from filechannel import Event
from filechannel import format as fmt


def _check(ev: Event) -> None:
    """The Event survives pickling and copying unchanged, and its headers serialise as JSON."""
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(ev, protocol=proto))
        assert back == ev
        assert type(back) is Event
    assert copy.deepcopy(ev) == ev
    assert json.loads(json.dumps(ev.headers)) == dict(ev.headers)


def test_an_event_built_without_headers_pickles_and_its_headers_are_json() -> None:
    ev = Event(b"body")
    _check(ev)
    assert json.dumps(ev.headers) == "{}"
    assert json.dumps(ev._asdict()["headers"]) == "{}"
    _check(Event(b"body", position=3))
    _check(Event(b"body", {"k": "v"}, 4))


def test_the_shared_empty_headers_refuse_changes() -> None:
    a, b = Event(b"a"), Event(b"b")
    with pytest.raises(TypeError, match="read-only"):
        a.headers["k"] = "v"  # type: ignore[index]
    for change in (
        lambda h: h.update(k="v"),
        lambda h: h.setdefault("k", "v"),
        lambda h: h.pop("k"),
        lambda h: h.popitem(),
        lambda h: h.clear(),
        lambda h: h.__delitem__("k"),
        lambda h: h.__ior__({"k": "v"}),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change(a.headers)
    assert b.headers == {}
    unpickled = pickle.loads(pickle.dumps(a)).headers
    with pytest.raises(TypeError, match="read-only"):
        unpickled["k"] = "v"  # type: ignore[index]
    mine = dict(a.headers)  # a copy is the caller's own
    mine["k"] = "v"
    assert a.headers == {}


@pytest.mark.parametrize("path", ["accelerated", "pure"])
def test_taken_events_pickle_and_their_headers_are_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    if path == "pure":
        monkeypatch.setattr(fmt, "speedups", None)
    elif fmt.speedups is None:
        pytest.skip(NO_ACCELERATOR)
    d = str(tmp_path / "ch")
    ch = filechannel.open(d)
    try:
        with ch.transaction() as tx:
            tx.put(b"plain")
            tx.put(b"with", {"region": "eu"})
            tx.put_many([b"m1", b"m2"])
            tx.put(Event(b"ev"))
        with ch.transaction() as tx:  # from the take cache
            cached = [tx.take(), *tx.take_batch(10)]
            tx.rollback()
        assert ch.stats()["cache_hits"] == 5
    finally:
        ch.close()
    ch = filechannel.open(d)
    try:
        with ch.transaction() as tx:  # after a restart: read from disk
            disk = tx.take_batch(10)
    finally:
        ch.close()
    for events in (cached, disk):
        assert [e.body for e in events if e is not None] == [b"plain", b"with", b"m1", b"m2", b"ev"]
        for ev in events:
            assert ev is not None
            _check(ev)
    assert [dict(e.headers) for e in disk] == [{}, {"region": "eu"}, {}, {}, {}]
