"""`profile`'s decode traffic (issue #54): a decode sends queries and partials, never its KV cache;
a pass-KV ring moves the cache; a ring of training shapes gets no decode figure."""

from __future__ import annotations

from harness.profiling.serving_traffic import serving_traffic

POOL_SIZE = 4


def test_decode_sends_queries_and_partials_and_the_cache_stays_put(pool):
    for impl in ("reference-decode", "reference-decode-a2a"):
        t = serving_traffic(impl, pool, 4)
        assert t is not None and len(t.every) == 4 and t.sent == max(t.every)
        # at least the all-to-all form's least, well under moving the cache
        assert t.all_to_all <= t.sent < t.kv_share / 4, t.line()
        assert "the KV cache stayed put" in t.line()
    # the all-gather merge sends every partial to every rank: about its form's least
    t = serving_traffic("reference-decode", pool, 4)
    assert 0.9 <= t.sent / t.all_gather <= 1.5, t.line()


def test_a_pass_kv_ring_moves_its_cache_and_a_training_ring_gets_no_figure(pool):
    t = serving_traffic("reference-pass-kv", pool, 4)
    assert t.sent >= t.kv_share * 0.9 and "the KV cache travelled" in t.line()
    assert serving_traffic("reference", pool, 4) is None
