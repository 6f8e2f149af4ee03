"""A first end-to-end check: put, restart, take, with positions."""

from __future__ import annotations

import filechannel


def test_put_restart_take(chan_dir: str) -> None:
    with filechannel.open(chan_dir, max_file_size=8192, minimum_required_space=0) as ch:
        for i in range(40):
            with ch.transaction() as tx:
                for j in range(5):
                    tx.put(f"{i}-{j}".encode(), headers={"i": str(i)})
        assert ch.size == 200
    with filechannel.open(chan_dir, max_file_size=8192, minimum_required_space=0) as ch:
        assert ch.size == 200
        with ch.transaction() as tx:
            evs = tx.take_batch(300)
        assert [e.position for e in evs] == list(range(200))
        assert evs[7].body == b"1-2"
        assert dict(evs[7].headers) == {"i": "1"}
        assert ch.size == 0
