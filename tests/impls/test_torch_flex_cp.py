"""The `torch-flex-cp` adapters (torch's flex-attention context parallelism) on CPU: the mask
mapping position by position, and torch's CP forward on gloo ranks against the float64 oracle.
flex_attention has no CPU backward, so the gradients (and the compiled variant) run on CUDA only
(docs/third-party.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.context import RunContext
from ring_impl.layouts import all_positions
from ring_impl.mask_eval import allowed
from ring_impl.masks import MASK_FEATURES, MaskSpec

flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
from harness.impls.adapters import torch_flex_cp  # noqa: E402  (after the skip: needs flex)
from tests.helpers import flex_ranks  # noqa: E402

RANKS_DEADLINE_S = 240


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.data())
def test_the_mask_mod_is_the_mask_at_every_position(data):
    """flex's own evaluation of `mask_mod` (create_mask, under vmap) equals `allowed` for every
    query row and key column, with rows and columns at drawn global positions (any layout's
    order)."""
    from harness.search.strategies import masks

    total = data.draw(st.integers(2, 40))
    spec = data.draw(
        masks(total, tuple(sorted(MASK_FEATURES)), boundaries=(0, total // 3, total // 2))
    )
    if spec.kind == "none":
        return
    kv = torch.tensor(data.draw(st.permutations(range(total))))
    rows = data.draw(st.integers(1, total))
    q = kv[torch.tensor(data.draw(st.permutations(range(total))))[:rows]]
    got = flex.create_mask(torch_flex_cp.mask_mod(spec, q, kv), 1, 1, rows, total, device="cpu")[
        0, 0
    ]
    assert torch.equal(got, allowed(spec, q, kv)), spec.describe()


def test_the_block_mask_covers_this_ranks_rows_against_the_gathered_keys():
    lengths = (5, 5, 5)
    ctx = RunContext(
        group=None,
        rank=1,
        world_size=3,
        global_ranks=(0, 1, 2),
        layout="zigzag",
        lengths=lengths,
        all_positions=tuple(all_positions("zigzag", list(lengths))),
        mask=MaskSpec("causal"),
        softmax_scale=1.0,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    bm = torch_flex_cp.block_mask(ctx.mask, ctx, compiled=False)
    assert bm.seq_lengths == (5, 15)
    assert torch_flex_cp.block_mask(MaskSpec("none"), ctx, compiled=False) is None


def _run_ranks(world_size: int, tmp_path) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.flex_ranks",
                str(r),
                str(world_size),
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + RANKS_DEADLINE_S
    try:
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} of {world_size} passed its deadline of {RANKS_DEADLINE_S} s")
            assert p.returncode == 0, f"rank {r} exit {p.returncode}: {out.decode()[-2000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


# ~25 s each in the suite, both in the slow tier (#55): the adapter runs only on CUDA, where
# scripts/gpu_check.py runs it; here its ranks are fresh interpreters
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_flex_cp_forward_equals_the_float64_oracle(world_size, tmp_path):
    """Every layout and mask family of `flex_ranks.cases`, GQA, rows that see nothing: each rank's
    out and lse from torch's CP (K/V all-gathered by its pre-hook, our BlockMask) equal the oracle's
    rows of that rank."""
    from harness.oracle.assemble import attention
    from ring_impl.layouts import positions

    got = _run_ranks(world_size, tmp_path)
    for i, (layout, per_rank, mask) in enumerate(flex_ranks.cases(world_size)):
        lengths = [per_rank] * world_size
        q, k, v = flex_ranks.inputs(sum(lengths), seed=i)
        exact = attention(q, k, v, torch.zeros_like(q), mask, flex_ranks.SCALE, torch.float64)
        for r in range(world_size):
            out, lse = got[r][i]
            pos = positions(layout, lengths, r)
            want_out, want_lse = exact.out[:, pos], exact.lse[:, :, pos]
            where = f"{layout} {mask.describe()} W{world_size} rank {r}"
            assert torch.allclose(out, want_out, rtol=0, atol=1e-12), where
            finite = want_lse.isfinite()
            # rows that see nothing: -inf on both sides
            assert torch.equal(lse.isfinite(), finite), where
            assert torch.allclose(lse[finite].double(), want_lse[finite], rtol=0, atol=1e-5), where


@pytest.mark.slow
def test_the_compiled_kernel_lowers_the_mask_mod_and_agrees_with_eager():
    """The compiled variant's pieces on CPU inductor (forward only: compiled flex on CPU has neither
    lse nor backward): the block mask built with `_compile=True` and the compiled kernel's lowering
    of `mask_mod` (pointwise code: a view, an expand or a tensor made inside it does not lower)
    agree with eager flex on documents, per-document operands, block tables, dilation and a prefix,
    at zigzag positions."""
    from ring_impl.masks import Expr, and_, not_, or_, prim

    lengths = (128, 128)
    pos = tuple(all_positions("zigzag", list(lengths)))
    g = torch.Generator().manual_seed(0)
    operand = or_(prim("dilated", 8, 2, 0), prim("window", 3, 9))
    table = prim("blocks", 16, ((1, 2), (3, 3), (0, 7)))
    for spec in (
        MaskSpec("document", doc_starts=(0, 50, 130), causal=True),
        MaskSpec.of(Expr("per-document", ((0, 17, 100),), (operand,))),
        MaskSpec.of(and_(or_(prim("prefix", 7), prim("causal")), not_(table))),
    ):
        ctx = RunContext(
            group=None,
            rank=1,
            world_size=2,
            global_ranks=(0, 1),
            layout="zigzag",
            lengths=lengths,
            all_positions=pos,
            mask=spec,
            softmax_scale=0.3,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        compiled_mask = torch_flex_cp.block_mask(spec, ctx, compiled=True)
        eager_mask = torch_flex_cp.block_mask(spec, ctx, compiled=False)
        assert torch.equal(compiled_mask.to_dense(), eager_mask.to_dense()), spec.describe()
        q = torch.randn(1, 2, 128, 16, generator=g)
        k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(2))
        with torch_flex_cp._recompiles(True):
            got = torch_flex_cp.flex_function(True)(q, k, v, block_mask=compiled_mask, scale=0.3)
        want = flex.flex_attention(q, k, v, block_mask=eager_mask, scale=0.3)
        assert torch.allclose(got, want, rtol=0, atol=1e-5), spec.describe()
