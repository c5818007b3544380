"""The serving case (issue #54): its field read and written, its lengths derived, its positions,
its mask within each request, and an oracle that matches dense float64 attention row by row."""

from __future__ import annotations

import pytest
import torch

from harness import inputs, serving_case
from harness.case import dumps, loads, make_case
from harness.errors import HarnessError
from harness.oracle.assemble import local
from ring_impl.mask_eval import allowed

REQ = {"context": [7, 3, 0], "new": [1, 2, 4], "kv": "interleaved", "interleave": 2}


def test_a_serving_case_round_trips_and_old_cases_keep_their_keys():
    c = make_case(world_size=3, serving=REQ, mask={"kind": "causal"}, call="inference-mode")
    assert c.seq_lens == serving_case.seq_lens(c.serving, 3) and c.total_len == 17
    back, _ = loads(dumps(c))
    assert back == c and back.key() == c.key()
    plain = make_case(world_size=3, total_len=17)
    assert "serving" not in dumps(plain) and plain.shape == "train" and c.shape == "prefill"


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"context": [1], "new": [0]}, "new"),
        ({"context": [1], "new": [1], "kv": "ring"}, "kv must be one of"),
        ({"context": [1], "new": [1], "interleave": 0}, "interleave"),
        ({"context": [1], "new": [1], "extra": 1}, "unknown key"),
        ({"context": [1, 2], "new": [1]}, "same requests"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_a_bad_serving_field_gets_one_line_naming_it(bad, words):
    with pytest.raises(HarnessError, match="serving") as e:
        make_case(world_size=2, serving=bad)
    assert words in str(e.value)


def test_a_serving_case_refuses_a_layout_wrong_lengths_and_fused_inputs():
    for extra, field in (
        ({"layout": "zigzag"}, "layout"),
        ({"seq_lens": (5, 5, 7)}, "seq_lens"),
        ({"inputs": "fused-qkv"}, "inputs"),
    ):
        with pytest.raises(HarnessError, match=f"case field '{field}'"):
            make_case(world_size=3, serving=REQ, **extra)


def test_queries_are_the_new_tokens_and_every_query_is_in_one_oracle_share():
    c = make_case(world_size=3, serving={**REQ, "queries": "replicated"})
    every = torch.tensor([7, 11, 12, 13, 14, 15, 16])
    for q in serving_case.query_positions(c):
        assert torch.equal(q, every)
    rows = torch.cat(serving_case.oracle_rows(c)).sort().values
    assert torch.equal(rows, every)


def _dense(c, name):
    return inputs.make(c, name, torch.arange(c.total_len)).double()


@pytest.mark.parametrize("kv", ["contiguous", "interleaved", "zigzag", "striped"])
@pytest.mark.parametrize("mask", [{"kind": "causal"}, {"kind": "window", "window": 3}])
def test_the_oracle_is_dense_attention_of_the_new_tokens_within_their_request(kv, mask):
    c = make_case(world_size=3, serving={**REQ, "kv": kv}, mask=mask, heads_q=4, heads_kv=2)
    exact, _ = local(c)
    q, k, v = (_dense(c, n) for n in ("q", "k", "v"))
    rows = torch.cat(serving_case.query_positions(c))
    m = allowed(serving_case.mask_of(c), rows, torch.arange(c.total_len))
    m = torch.ones(rows.numel(), c.total_len, dtype=torch.bool) if m is None else m
    k, v = (t.repeat_interleave(2, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q[:, rows], k) * c.scale
    s = s.masked_fill(~m, float("-inf"))
    want = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)
    assert torch.allclose(exact.out[:, rows], want, atol=1e-12)
    assert torch.allclose(exact.lse[:, :, rows], s.logsumexp(-1), atol=1e-12)
    # request 2's first new token sees only itself; no query sees across a request
    starts = c.serving.starts
    assert not bool(m[:, : starts[2]][rows >= starts[2]].any())
