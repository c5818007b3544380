"""Generation, shrinking and capabilities of the mask language and idle ranks (issue #16)."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.case import make_case
from harness.context import Capabilities, RunContext
from harness.impls.adapters import _common
from harness.impls.adapters.reference import REFERENCE_CAPABILITIES
from harness.impls.capabilities import adapt, case_features, unsupported
from harness.search.shrink import candidates, case_size, simpler_expressions
from harness.search.strategies import boundary_positions, cases, primitives
from ring_impl.layouts import all_positions
from ring_impl.masks import MASK_KINDS, MaskSpec, and_, not_, or_, prim

SETTINGS = settings(
    max_examples=300,
    suppress_health_check=list(HealthCheck),
    deadline=None,
    database=None,
    derandomize=True,
)


def test_reference_draws_expressions_and_idle_ranks_legacy_caps_draw_neither():
    seen: Counter = Counter()

    @SETTINGS
    @given(cases(REFERENCE_CAPABILITIES))
    def ref(c):
        seen["expr" if c.mask.kind == "expr" else "legacy"] += 1
        seen["idle"] += 0 in c.seq_lens
        assert c.total_len >= 1 and any(c.seq_lens)
        for name in c.mask.needs():
            seen[name] += 1

    ref()
    assert seen["expr"] >= 30 and seen["idle"] >= 10
    assert all(
        seen[p]
        for p in (
            "window",
            "chunked",
            "dilated",
            "prefix",
            "document",
            "blocks",
            "inverse-causal",
            "and",
            "or",
            "not",
            "per-document",
        )
    )

    @SETTINGS
    @given(cases(Capabilities()))
    def legacy(c):
        assert c.mask.kind in MASK_KINDS and 0 not in c.seq_lens

    legacy()


def test_primitive_parameters_lean_on_shard_edges():
    lens = (7, 5, 9, 6)
    edges = tuple(boundary_positions("contiguous", lens))
    hits: Counter = Counter()

    @SETTINGS
    @given(primitives(sum(lens), frozenset({"chunked", "prefix"}), edges))
    def draw(e):
        v = e.params[0]
        hits[e.op, any(abs(v - b) <= 1 for b in edges + (7, 5, 9, 6))] += 1

    draw()
    # uniform draws over 1..27 would land within one of an edge or shard length about a third of the
    # time
    for op in ("chunked", "prefix"):
        assert hits[op, True] > 1.2 * hits[op, False], hits


def test_shrinking_an_expression_goes_to_simpler_ones():
    e = and_(
        prim("document", (0, 5, 9)),
        or_(prim("chunked", 6), prim("prefix", 4)),
        not_(prim("dilated", 8, 2, 1)),
    )
    simpler = list(simpler_expressions(e))
    assert simpler[:3] == list(e.args)  # an operand alone first
    assert all(x.size() <= e.size() for x in simpler) and len(set(simpler)) == len(simpler)
    assert prim("chunked", 3) in [a for x in simpler if x.op == "and" for a in x.args[1].args]
    c = make_case(
        world_size=2,
        total_len=12,
        mask={"and": [{"kind": "causal"}, {"kind": "chunked", "size": 4}]},
    )
    masks = [v.mask for v in candidates(c) if v.mask != c.mask]
    assert MaskSpec("causal") in masks and all(
        case_size(c.replace(mask=m)) <= case_size(c) for m in masks
    )
    assert MaskSpec.of(and_(prim("causal"), prim("chunked", 2))) in masks  # a smaller chunk


def test_idle_ranks_and_expressions_are_capabilities():
    c = make_case(
        world_size=3,
        seq_lens=(5, 0, 6),
        mask={"and": [{"kind": "causal"}, {"kind": "chunked", "size": 4}]},
    )
    assert (
        "idle" in case_features(c)
        and "mask:chunked" in case_features(c)
        and "mask:expr" in case_features(c)
    )
    caps = Capabilities()
    assert unsupported(caps, c) == ["mask:expr", "mask:chunked", "mask:and", "idle"]
    assert unsupported(REFERENCE_CAPABILITIES, c) == []
    a = adapt(caps, c)
    assert a.mask == MaskSpec("causal") and a.seq_lens == (5, 1, 6) and not unsupported(caps, a)
    non_causal = c.replace(mask=MaskSpec.of(prim("dilated", 4, 2, 1)))
    assert adapt(caps, non_causal).mask == MaskSpec("none")


def test_an_adapter_refuses_an_undeclared_expression_in_one_line():
    c = make_case(
        world_size=2,
        total_len=8,
        mask={"or": [{"kind": "causal"}, {"kind": "prefix", "length": 3}]},
    )
    pos = tuple(all_positions(c.layout, c.seq_lens))
    ctx = RunContext(
        group=None,
        rank=0,
        world_size=2,
        global_ranks=(0, 1),
        layout=c.layout,
        lengths=c.seq_lens,
        all_positions=pos,
        mask=c.mask,
        softmax_scale=0.25,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    q = torch.zeros(1, 4, 2, 8)
    caps = Capabilities(masks=frozenset({"none", "causal"}))
    why = _common.unsupported_reasons(ctx, caps, q, q)
    assert why[-1].startswith("mask or (the mask is causal|prefix(3); declared: causal, none)"), why
    try:
        _common.require_supported("lib", ctx, caps, q, q)
    except Exception as e:  # ImplError: one line naming every missing piece and the expression
        assert "\n" not in str(e) and "mask prefix" in str(e) and "causal|prefix(3)" in str(e)
    else:
        raise AssertionError("an undeclared expression was accepted")


@given(st.data())
@settings(max_examples=50, suppress_health_check=list(HealthCheck), deadline=None, database=None)
def test_drawn_cases_are_valid_and_round_trip(data):
    from harness.case import from_dict, to_dict

    c = data.draw(cases(REFERENCE_CAPABILITIES, max_tokens=24))
    assert from_dict(to_dict(c)) == c


def test_shrinking_a_per_document_mask_keeps_its_starts_or_drops_one():
    from ring_impl.masks import Expr

    e = Expr("per-document", ((0, 4, 9),), (or_(prim("causal"), prim("prefix", 2)),))
    simpler = list(simpler_expressions(e))
    assert simpler[0] == e.args[0]
    assert Expr("per-document", ((0, 9),), e.args) in simpler
    assert Expr("per-document", ((0, 4, 9),), (prim("causal"),)) in simpler
