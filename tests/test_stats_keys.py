"""stats(): the keys it returns, the TypedDict and docs/stats.md name the same keys."""

from __future__ import annotations

import re
from pathlib import Path

import filechannel
from filechannel.stats import ChannelStats, ConsumerStats

DOC = (Path(__file__).resolve().parent.parent / "docs" / "stats.md").read_text(encoding="utf-8")


def test_the_keys_the_type_and_the_docs_agree(tmp_path: Path) -> None:
    d = str(tmp_path / "ch")
    with filechannel.open(d, minimum_required_space=0, background=False) as ch:
        with ch.transaction() as tx:
            tx.put(b"x")
        filechannel.ChannelReader(d, "c1").available()
        st = ch.stats()
        assert len(ch) == st["queue_size"] == 1
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", DOC, re.M))
    assert set(st) == set(ChannelStats.__annotations__) == documented
    assert set(st["consumers"]["c1"]) == set(ConsumerStats.__annotations__)
