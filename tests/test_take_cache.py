"""The take cache (``filechannel._cache``) against a plain model: what it holds, counts and evicts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from filechannel._cache import OVERHEAD, TakeCache, take_tuples

# An operation: ("add", n events, body size, out_of_order) or ("pop", positions as offsets from the lowest live one).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 6), st.integers(0, 40), st.booleans()),
        st.tuples(st.just("pop"), st.lists(st.integers(-3, 40), max_size=30)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, limit=st.integers(0, 1500))
def test_matches_a_model(ops: list[tuple], limit: int) -> None:
    cache = TakeCache(limit)
    model: dict[int, tuple[int, dict[int, tuple[bytes, dict[str, str]]]]] = {}  # first -> (n, held slots)
    nxt = 100
    spare: list[int] = []  # first positions kept back to add later, out of order
    for op in ops:
        if op[0] == "add":
            _, n, size, late = op
            if late and spare:
                first = spare.pop()
            else:
                first = nxt
                nxt += max(n, 1) + 3
                if late:  # leave a gap here and fill it on a later "add"
                    spare.append(first)
                    first = nxt
                    nxt += max(n, 1) + 3
            bodies = [bytes([first % 256, k]) * size for k in range(n)]
            headers = [{"k": str(first + k)} for k in range(n)]
            cache.add(first, bodies, headers)
            if n and limit:
                model[first] = (n, {first + k: (bodies[k], headers[k]) for k in range(n)})
                total = sum(len(b) + OVERHEAD for _, held in model.values() for b, _ in held.values())
                for f in sorted(model):  # evict whole runs, lowest positions first
                    if total <= limit:
                        break
                    total -= sum(len(b) + OVERHEAD for b, _ in model.pop(f)[1].values())
        else:
            low = min(model, default=nxt)
            positions = sorted({low + d for d in op[1]})  # as the queue hands them out
            got = cache.pop(positions)
            want = []
            for p in positions:
                hit = None
                for _n, held in model.values():
                    if p in held:
                        body, hdrs = held.pop(p)
                        hit = (body, hdrs, p)
                        break
                want.append(hit)
            for f in [f for f, (_n, held) in model.items() if not held]:
                del model[f]
            assert got == want
            assert cache.last_hits == len(want) - want.count(None)
        assert len(cache) == sum(len(held) for _, held in model.values())
        assert cache.nbytes == sum(len(b) + OVERHEAD for _, held in model.values() for b, _ in held.values())
        assert cache.nbytes <= limit or not limit


def test_a_full_cache_keeps_the_newest_commits() -> None:
    cache = TakeCache(10 * (100 + OVERHEAD))
    for first in range(0, 50, 5):
        cache.add(first, [b"x" * 100] * 5, [{}] * 5)
    assert len(cache) == 10  # two commits of five fit
    got = cache.pop(list(range(50)))
    assert [p for p, c in enumerate(got) if c is not None] == list(range(40, 50))
    assert len(cache) == 0
    assert cache.nbytes == 0


def test_pop_hands_each_consecutive_stretch_to_take() -> None:
    cache = TakeCache(1 << 20)
    # Added out of position order (two data directories), so they stay two runs.
    cache.add(13, [b"d", b"e"], [{}, {}])
    cache.add(10, [b"a", b"b", b"c"], [{}, {"k": "v"}, {}])
    calls: list[tuple[list[bytes], int, int, int]] = []

    def take(bodies: list[Any], headers: Any, a: int, m: int, first: int) -> tuple[list[Any], int]:
        calls.append((list(bodies), a, m, first))
        items, nbytes = take_tuples(bodies, headers, a, m, first)
        return [("ev", p, b, dict(h)) for b, h, p in items], nbytes

    got = cache.pop([11, 12, 13, 14, 20], take)
    # one call per run's consecutive stretch; a position not held is None
    assert calls == [([b"a", b"b", b"c"], 1, 2, 11), ([b"d", b"e"], 0, 2, 13)]
    assert got == [("ev", 11, b"b", {"k": "v"}), ("ev", 12, b"c", {}), ("ev", 13, b"d", {}), ("ev", 14, b"e", {}), None]
    assert cache.nbytes == 1 + OVERHEAD  # what take reported is what the cache stopped counting
    assert cache.pop([10]) == [(b"a", {}, 10)]  # the default: a (body, headers, position) tuple per event
    assert cache.events == 0
    assert cache.nbytes == 0


def _held_by_cache(tmp_path: Any, body_size: int, n_headers: int, n: int) -> tuple[int, int]:
    """Fill a channel's take cache past its 1 MiB bound; return (memory the cache holds, its cache_bytes).

    The same puts go into a channel without a cache: the difference in memory still allocated
    (tracemalloc) after the commits is what the cache holds.
    """
    import gc
    import os
    import tracemalloc

    import filechannel

    held: dict[int, int] = {}
    counted = 0
    for limit in (0, 1 << 20):
        d = tmp_path / f"c{limit}"
        with filechannel.open(str(d), cache_bytes=limit, capacity=max(10 * n, 10_000)) as ch:
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                batch = max(1, min(100, n // 40))  # commits well under the bound: the cache fills up
                for _ in range(n // batch):
                    with ch.transaction() as tx:
                        for _ in range(batch):
                            hdrs = {f"key{j}": os.urandom(6).hex() for j in range(n_headers)}
                            tx.put(os.urandom(body_size), hdrs or None)
                gc.collect()
                held[limit] = tracemalloc.get_traced_memory()[0] - base
            finally:
                tracemalloc.stop()
            if limit:
                counted = ch.stats()["cache_bytes"]
    return held[1 << 20] - held[0], counted


def test_cache_bytes_counts_what_small_events_with_headers_cost(tmp_path: Any) -> None:
    # 10-byte bodies with three headers: the cache must count about what they really hold.
    real, counted = _held_by_cache(tmp_path, 10, 3, 16_000)
    assert counted > (1 << 20) * 0.9  # the cache is full
    assert real <= 1.3 * counted, (real, counted)


def test_cache_bytes_counts_what_large_events_cost(tmp_path: Any) -> None:
    real, counted = _held_by_cache(tmp_path, 20_000, 0, 200)
    assert counted > (1 << 20) * 0.9
    assert real <= 1.3 * counted, (real, counted)


def test_headers_are_counted_and_given_back_whole() -> None:
    from filechannel._cache import HEADER_ENTRY, HEADERS_OVERHEAD
    from filechannel.format import encode_event

    cache = TakeCache(1 << 20)
    bodies = [b"a" * 10, b"b" * 20, b"c", b"d" * 5]
    headers = [{"k": "v" * 30}, {}, {"x": "1", "y": "22"}, {}]
    payload_bytes = sum(len(encode_event(b, h)) for b, h in zip(bodies, headers, strict=True))
    cache.add(7, bodies, headers, payload_bytes)
    assert cache.nbytes == payload_bytes + OVERHEAD * 4 + HEADERS_OVERHEAD * 2 + HEADER_ENTRY * 3
    for positions in ([7], [9], [8], [10]):  # out of order, one at a time: the counts still come back to 0
        cache.pop(positions)
        assert cache.nbytes > 0 or positions == [10]
    assert (cache.events, cache.nbytes) == (0, 0)


def test_one_event_commits_share_runs_so_the_collector_has_few_objects_to_walk() -> None:
    # A producer committing one event at a time: each commit is a run object and two lists when
    # kept apart, which every full garbage collection walks (pausing every thread): merged, a few
    # objects per thousand events. What the cache serves, counts and evicts is unchanged.
    import gc

    n = 4096
    cache = TakeCache(1 << 30)
    before = len(gc.get_objects())
    for p in range(n):
        cache.add(p, [b"x%d" % p], [{}])
    grown = len(gc.get_objects()) - before
    assert grown <= n // 64, f"{grown} objects tracked for {n} one-event commits"
    assert len(cache) == n
    assert cache.nbytes == sum(len(b"x%d" % p) + OVERHEAD for p in range(n))
    assert cache.pop([0, 1, 2000, n - 1]) == [
        (b"x0", {}, 0),
        (b"x1", {}, 1),
        (b"x2000", {}, 2000),
        (b"x4095", {}, 4095),
    ]
    assert len(cache) == n - 4
    assert cache.pop([1, 2, 3]) == [None, (b"x2", {}, 2), (b"x3", {}, 3)]
