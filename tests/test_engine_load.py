"""`EngineLoad` (online_opd/train/load.py) by hand, with the report times given."""

from __future__ import annotations

from online_opd.train.load import EngineLoad


def test_engine_load_is_idle_only_after_every_fresh_source_stayed_idle():
    """`EngineLoad` by hand: idle once each reporting source's last busy (or unknown, or first) report
    lies `idle_after_s` back; no source, or only stale ones, is not idle."""
    load = EngineLoad(idle_after_s=10.0, stale_s=30.0)
    assert not load.idle(at=100.0)  # nobody reported: as if serving
    load.report("a", False, at=100.0)
    assert not load.idle(at=105.0) and load.idle(at=110.0)  # idle from its first report on
    load.report("a", True, at=111.0)
    load.report("a", False, at=113.0)
    assert not load.idle(at=120.0) and load.idle(at=121.0)  # 10 s after the last busy report
    load.report("a", None, at=122.0)  # unreadable: counts as busy
    assert not load.idle(at=140.0)  # until a report says idle
    load.report("a", False, at=141.0)
    assert load.idle(at=141.0)  # its last busy (unknown) report lies 19 s back
    load.report("b", False, at=145.0)
    assert not load.idle(at=154.0) and load.idle(at=155.0)  # both sources must be idle
    load.report("b", True, at=156.0)
    assert not load.idle(at=160.0)
    assert not load.idle(at=187.0)  # a (141) and b (156) silent for over 30 s: nobody left
    load.report("a", False, at=190.0)
    assert not load.idle(at=191.0) and load.idle(at=200.0)  # a is back; b no longer counts
