"""The paged KV input form (issue #54): page pools and block tables as engines hold them, the case
field that asks for them, the declaration that gets them, and the rings that read them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.case import dumps, loads, make_case
from harness.context import Capabilities
from harness.errors import HarnessError, ImplError
from harness.impls.adapters.reference import DECODE_CAPABILITIES
from harness.impls.capabilities import adapt, unsupported
from harness.paged import block_tables, present
from harness.runner import run_case
from harness.search.serving_draws import battery_cases
from ring_impl.paged import NULL_PAGE, PagedKV, read_pages, slots

REQ = {"context": [9, 0, 20], "new": [1, 2, 3], "kv": "interleaved", "interleave": 2}
W = 3
POOL_SIZE = 3


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_pages_are_distinct_shuffled_never_the_null_page_and_read_back_exactly(page_size):
    gen = torch.Generator().manual_seed(page_size)
    lengths = (37, 0, 5)
    tables, pages = block_tables(lengths, 2, page_size, gen)
    used = [int(p) for b in range(2) for r, n in enumerate(lengths)
            for p in tables[b, r, : -(-n // page_size)]]  # fmt: skip
    assert len(set(used)) == len(used) and NULL_PAGE not in used and max(used) < pages
    assert pages > len(used) + 1  # free pages beside the null page
    if page_size <= 3:
        assert used != sorted(used)  # not in position order
    paged = PagedKV(page_size, tables, lengths)
    k = torch.randn(2, sum(lengths), 2, 4)
    from harness.paged import _pool

    pool = _pool(k, slots(paged), pages, page_size, gen)
    assert pool.shape == (pages, page_size, 2, 4)
    assert torch.equal(read_pages(pool, paged), k)
    # every slot no token fills holds stale values, the null page too
    assert pool[NULL_PAGE].abs().sum() > 0


def test_a_read_past_a_requests_pages_reads_the_null_page():
    tables = torch.tensor([[[4, 2]]])
    paged = PagedKV(2, tables, (3,))
    assert slots(paged, (6,)).tolist() == [[8, 9, 4, 5, 0, 1]]


def test_present_hands_pools_and_reads_the_gradients_back_at_the_tokens_slots():
    from harness.calls import present as present_views
    from harness.ranks.execute import serving_info

    c = make_case(world_size=W, serving={**REQ, "page_size": 4})
    info = serving_info(c.serving, W)
    q, k, v, dout = (torch.randn(1, n, 2, 8) for n in (3, 12, 12, 3))
    from harness.context import RunContext
    from ring_impl.masks import MaskSpec

    ctx = RunContext(None, 1, W, (0, 1, 2), "contiguous", c.seq_lens, (), MaskSpec("causal"),
                     1.0, torch.float32, torch.device("cpu"), seed=5, serving=info)  # fmt: skip
    x, ctx2 = present(present_views("contiguous", q, k, v, dout, True), ctx, True)
    assert x.k.dim() == 4 and x.k.shape[1] == 4 and ctx2.pages.lengths == info.kv_lengths[1]
    got = read_pages(x.k, ctx2.pages)
    assert torch.equal(got, k)
    (got * 2).sum().backward()
    assert torch.equal(x.grads()[1], torch.full_like(k, 2.0))


def test_the_field_round_trips_and_bad_page_sizes_and_forms_are_one_line():
    c = make_case(world_size=W, serving={**REQ, "page_size": 16}, call="inference-mode")
    assert "paged/16" in c.summary() and "page_size: 16" in dumps(c)
    back, _ = loads(dumps(c))
    assert back == c and back.key() == c.key()
    plain = make_case(world_size=W, serving=REQ)
    assert plain.serving.page_size == 0 and "page_size" not in dumps(plain)
    for bad in (-1, 5000, "4", True):
        with pytest.raises(HarnessError, match="page_size must be an integer in"):
            make_case(world_size=W, serving={**REQ, "page_size": bad})
    with pytest.raises(HarnessError, match="paged KV cache"):
        make_case(world_size=W, serving={**REQ, "page_size": 2}, inputs="transposed")


def test_only_a_declared_paged_form_gets_paged_cases():
    with pytest.raises(ImplError, match="input_forms"):
        Capabilities(input_forms={"pages"})
    assert "paged" not in Capabilities().input_forms
    unpaged = dataclasses.replace(
        DECODE_CAPABILITIES, input_forms=DECODE_CAPABILITIES.input_forms - {"paged"}
    )
    paged = [kw for kw in battery_cases(4, DECODE_CAPABILITIES) if kw["serving"].get("page_size")]
    assert sorted(kw["serving"]["page_size"] for kw in paged) == [1, 4, 16]
    assert not [kw for kw in battery_cases(4, unpaged) if kw["serving"].get("page_size")]
    c = make_case(world_size=W, serving={**REQ, "page_size": 4}, call="inference-mode")
    assert unsupported(unpaged, c) == ["inputs:paged"] and not unsupported(DECODE_CAPABILITIES, c)
    assert adapt(unpaged, c).serving == dataclasses.replace(c.serving, page_size=0)


@pytest.mark.parametrize(
    "impl, call",
    [("reference-decode-a2a", "inference-mode"), ("reference-pass-q", "inference-mode"),
     ("reference-pass-kv", "train")],
)  # fmt: skip
def test_the_references_read_pages_of_every_size(pool, impl, call):
    for size in (1, 5, 64):
        c = make_case(world_size=W, serving={**REQ, "page_size": size}, dtype="bf16",
                      mask={"kind": "causal"}, call=call, heads_q=4, heads_kv=2)  # fmt: skip
        r = run_case(c, pool, impl)
        assert r.passed, (c.summary(), r.detail)
    assert ("dk" in {x.tensor for x in r.checks}) == (call == "train")


def test_the_global_length_pages_mutant_fails_paged_and_passes_contiguous_shares(pool):
    c = make_case(world_size=W, serving={**REQ, "page_size": 4}, mask={"kind": "causal"},
                  call="inference-mode")  # fmt: skip
    bad = run_case(c, pool, "mutant:decode-pages-by-global-length")
    assert not bad.passed and bad.verdict == "silent-corruption", bad.detail
    unpaged = c.replace(serving=dataclasses.replace(c.serving, page_size=0))
    assert run_case(unpaged, pool, "mutant:decode-pages-by-global-length").passed


def test_the_forward_only_references_refuse_a_call_that_needs_a_backward():
    from ring_impl.decode import decode_attention
    from ring_impl.pass_q import pass_q_attention

    q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
    pos = (torch.arange(4),)
    for fn in (decode_attention, pass_q_attention):
        with pytest.raises(RuntimeError, match="forward-only"):
            fn(q, k, v, positions=pos, q_positions=pos)
        with torch.no_grad():
            out, lse = fn(q, k, v, positions=pos, q_positions=pos)
        assert out.shape == q.shape and lse.shape == (1, 2, 4)
