"""The leak run as a second backward through the first call's graph (issue #55).

A training call's leak run no longer calls the ring again: it runs a second backward, with the
chosen queries' dout, through the graph the first call kept. These tests hold it to the old way,
a second forward and backward, bit for bit. One process, W = 1, no process group.
"""

from __future__ import annotations

import pytest
import torch

from harness import calls
from harness.case import Case
from harness.impls import registry
from harness.ranks import execute
from ring_impl.masks import MaskSpec

MASKS = [MaskSpec("causal"), MaskSpec("window", window=5), MaskSpec("document", doc_starts=(0, 9))]


def _case(mask: MaskSpec, **kw) -> Case:
    base = dict(world_size=1, seq_lens=(24,), heads_q=4, heads_kv=2, head_dim=8, seed=3)
    return Case(mask=mask, **{**base, **kw})


def _both(case: Case, impl: str = "reference") -> tuple[dict, dict]:
    """The reply with the retained backward, then with a second call."""
    ring = registry.resolve(impl)
    cpu = torch.device("cpu")
    retained = execute.run_on_rank(case, ring, None, cpu, leak=True)
    saved = calls.RETAINED_LEAK
    calls.RETAINED_LEAK = ()
    try:
        again = execute.run_on_rank(case, ring, None, cpu, leak=True)
    finally:
        calls.RETAINED_LEAK = saved
    return retained, again


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.kind)
@pytest.mark.parametrize("form", calls.INPUT_FORMS)
def test_the_retained_backward_gives_the_second_calls_leak_gradients(mask, form):
    retained, again = _both(_case(mask, inputs=form))
    assert set(retained["leak"]) == {"dk", "dv"}
    for name in ("dk", "dv"):
        assert torch.equal(retained["leak"][name], again["leak"][name]), name
    # the judged results are those of the first backward, untouched by the second
    assert retained["hashes"] == again["hashes"]
    assert retained["timings"]["leak_s"] > 0


def test_the_sinks_gradient_is_the_first_backwards_alone():
    case = _case(MaskSpec("causal"), sinks=(0.5, -1.0, 0.0, 2.0))
    retained, again = _both(case)
    assert torch.equal(retained["tensors"]["dsinks"], again["tensors"]["dsinks"])
    assert torch.equal(retained["leak"]["dk"], again["leak"]["dk"])


@pytest.mark.parametrize("call", ["checkpoint", "checkpoint-reentrant"])
def test_a_checkpointed_call_keeps_its_second_call(call):
    assert call not in calls.RETAINED_LEAK
    retained, again = _both(_case(MaskSpec("causal"), call=call))
    assert torch.equal(retained["leak"]["dv"], again["leak"]["dv"])


def test_no_leak_run_without_a_mask_or_a_backward():
    ring, cpu = registry.resolve("reference"), torch.device("cpu")
    assert "leak" not in execute.run_on_rank(_case(MaskSpec()), ring, None, cpu, leak=True)
    case = _case(MaskSpec("causal"), call="no-grad")
    assert "leak" not in execute.run_on_rank(case, ring, None, cpu, leak=True)
