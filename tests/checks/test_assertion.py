"""`assert_ring_close`: one call for a user's own test; raises AssertionError with the localised
report."""

from __future__ import annotations

import pytest

from harness import HarnessError, assert_ring_close, make_case


def test_passes_and_returns_the_results(tmp_path):
    c = make_case(world_size=2, total_len=9, mask={"kind": "causal"}, heads_q=4, heads_kv=2)
    results = assert_ring_close("reference", c)
    assert [r.verdict for r in results] == ["pass"]


def test_a_failing_case_raises_with_the_localised_report(tmp_path):
    c = make_case(world_size=2, total_len=12, mask={"kind": "causal"})
    with pytest.raises(AssertionError) as e:
        assert_ring_close("mutant:causal-step-off-by-one", c, save_dir=str(tmp_path))
    text = str(e.value)
    assert text.startswith(
        "mutant:causal-step-off-by-one: 1 of 1 case(s) failed against float64 attention"
    )
    assert "silent-corruption: W2 contiguous causal" in text and "rank" in text and "where:" in text
    saved = list(tmp_path.glob("*.yaml"))
    assert len(saved) == 1 and str(saved[0]) in text
    # the saved file is a case too: the same assertion on it fails the same way
    with pytest.raises(AssertionError, match="silent-corruption"):
        assert_ring_close("mutant:causal-step-off-by-one", saved[0])


def test_the_battery_by_default_and_bad_input(tmp_path):
    results = assert_ring_close("reference", world_size=2, dtype="fp32")
    assert len(results) > 20 and all(r.passed for r in results)
    with pytest.raises(HarnessError, match="bind it to a module-level name"):
        assert_ring_close(lambda q, k, v, ctx: q)
    with pytest.raises(HarnessError):
        assert_ring_close("no-such-ring")


def test_an_impl_object_or_a_run_function_is_taken_by_its_module_level_name():
    """As torch.testing users pass objects: the ranks import it by the name it has in its module."""
    from tests.helpers import impls

    c = make_case(world_size=2, total_len=8, mask={"kind": "causal"})
    assert assert_ring_close(impls.reference, c)[0].impl == "tests.helpers.impls:reference"
    with pytest.raises(AssertionError, match="silent-corruption"):
        assert_ring_close(impls.leaky, c)
