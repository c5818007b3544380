"""The calls and input forms of a case (harness.calls), the value kinds of trained models
(harness.inputs), and what the capability rule does with them (issue #40). No ranks: a single
process."""

from __future__ import annotations

import pytest
import torch

from harness import calls, inputs
from harness import case as case_mod
from harness.case import make_case
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.impls.capabilities import adapt, case_features, feature_words, unsupported


def _shards(hq=4, hkv=2, b=2, s=5, d=8):
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(b, s, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, generator=g) for _ in range(2))
    return q, k, v, dout


@pytest.mark.parametrize("form", calls.INPUT_FORMS)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_every_form_hands_the_same_values_and_gradients_come_home(form, heads):
    q, k, v, dout = _shards(*heads)
    x = calls.present(form, q, k, v, dout, grad=True)
    for got, want in ((x.q, q), (x.k, k), (x.v, v), (x.dout, dout)):
        assert torch.equal(got, want) and got.stride(-1) == 1
    views = {"fused-qkv": (x.q, x.k, x.v), "transposed": (x.q, x.k, x.v), "strided-dout": (x.dout,)}
    assert all(not t.is_contiguous() for t in views.get(form, ()))
    ((x.q * 2).sum() + x.k.sum() + (x.v * 3).sum()).backward()
    dq, dk, dv = x.grads()
    assert torch.equal(dq, torch.full_like(q, 2.0)) and torch.equal(dk, torch.ones_like(k))
    assert torch.equal(dv, torch.full_like(v, 3.0))


@pytest.mark.parametrize("call", calls.CALLS)
def test_each_call_runs_the_forward_its_way(call):
    q, k, v, _ = _shards()
    seen = []

    def fn(q, k, v):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return (q * k.mean() + v.mean()), None

    x = calls.present("contiguous", q, k, v, q, grad=calls.needs_backward(call))
    out, _ = calls.forward(call, fn, x.q, x.k, x.v)
    if calls.needs_backward(call):
        out.sum().backward()
        assert x.leaves[0].grad is not None
    first = {
        "train": (True, False),
        "no-grad": (False, False),
        "inference-mode": (False, True),
        "checkpoint-reentrant": (False, False),
        "checkpoint": (True, False),
    }[call]
    assert seen[0] == first
    assert len(seen) == (2 if call.startswith("checkpoint") else 1)  # the recompute inside backward


def test_call_and_inputs_are_case_fields_kept_out_of_old_files():
    plain = make_case(world_size=2, total_len=6)
    assert "call" not in case_mod.to_dict(plain) and "inputs" not in case_mod.to_dict(plain)
    c = make_case(
        world_size=2, total_len=6, call="checkpoint-reentrant", inputs="fused-qkv", values="sink"
    )
    back, _ = case_mod.loads(case_mod.dumps(c))
    assert back == c and "call=checkpoint-reentrant inputs=fused-qkv" in c.summary()
    with pytest.raises(HarnessError, match="case field 'call'"):
        make_case(world_size=2, total_len=6, call="eval")
    with pytest.raises(HarnessError, match="case field 'inputs'"):
        make_case(world_size=2, total_len=6, inputs="packed")


def test_a_forward_only_ring_gets_forward_only_calls_and_a_probe_of_backward():
    fwd = Capabilities(backward=False)
    train = make_case(world_size=2, total_len=6)
    assert unsupported(fwd, train) == ["backward"] and adapt(fwd, train).call == "no-grad"
    ckpt = train.replace(call="checkpoint")
    assert adapt(fwd, ckpt).call == "no-grad"
    serve = train.replace(call="inference-mode")
    assert unsupported(fwd, serve) == [] and adapt(fwd, serve) == serve
    assert "backward" in case_features(train) and "call:inference-mode" in case_features(serve)
    assert feature_words("backward", fwd) == "a backward pass (a training or checkpointed call)"
    # no backward, no dout
    assert adapt(fwd, train.replace(inputs="strided-dout")).inputs == "contiguous"
    assert adapt(fwd, train.replace(inputs="fused-qkv")).inputs == "fused-qkv"


def test_a_ring_that_needs_contiguous_inputs_gets_them():
    narrow = Capabilities(input_forms={"contiguous"})
    c = make_case(world_size=2, total_len=6, inputs="transposed")
    assert unsupported(narrow, c) == ["inputs:transposed"]
    assert adapt(narrow, c).inputs == "contiguous"
    with pytest.raises(Exception, match="input_forms"):
        Capabilities(input_forms={"packed"})


@pytest.mark.parametrize("head_dim", [1, 2, 16, 32, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_qk_overflow_passes_fp16_range_while_scaled_logits_stay_finite(head_dim, dtype):
    c = make_case(world_size=2, total_len=10, values="qk-overflow", dtype=dtype, head_dim=head_dim)
    pos = torch.arange(10)
    q, k = (inputs.make(c, n, pos).double() for n in ("q", "k"))
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k)
    scaled = raw.abs().max() * c.scale
    assert scaled < 0.51 * inputs.FP16_MAX
    # head_dim 7 and up; a larger scale holds the product so the logits stay in range
    if c.scale <= 0.4:
        assert raw.abs().min() > inputs.FP16_MAX


def test_a_sink_takes_most_of_every_row_and_outliers_sit_in_their_channels():
    c = make_case(world_size=2, total_len=40, values="sink", head_dim=16, mask={"kind": "causal"})
    pos = torch.arange(40)
    q, k, v = (inputs.make(c, n, pos).double() for n in ("q", "k", "v"))
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) * c.scale, dim=-1)
    assert float(p[..., 0].min()) > 0.5  # one key dominates every row
    assert float(v[:, 0].abs().max()) < 0.2 * float(v[:, 1:].abs().max())
    o = make_case(world_size=2, total_len=40, values="outliers", head_dim=16)
    x = inputs.make(o, "k", pos)
    ch = inputs.outlier_channels(16)
    assert float(x[..., ch].abs().mean()) > 5 * float(x[..., : ch.start].abs().mean())
