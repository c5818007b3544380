"""The mutant zoo as selftest needs it: never imported with the reference, every mutant documented
(what it reproduces, where it shows), and the numerical mutants visible under the tolerance rule
while the reference stays silent on the same cases."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.case import make_case
from harness.judging import tolerance
from ring_impl.mutants import MUTANTS

# the public projects the zoo's reports come from, or an explicit statement that there is no single
# one
SOURCES = (
    "ring-flash-attention",
    "ring-attention-pytorch",
    "long-context-attention",
    "yunchang",
    "EasyContext",
    "diffusers",
    "Striped Attention",
    "flash-attn",
    "MagiAttention",
    "Megatron-LM",
    "pytorch/pytorch",
    "GPT-NeoX",
    "TransformerEngine",
    "vLLM",
    "SGLang",
    "TokenSpeed",
    "no single public report",
)


def test_importing_the_reference_does_not_import_the_mutants():
    code = (
        "import sys, ring_impl, harness.impls.registry; print('ring_impl.mutants' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_says_what_it_reproduces_and_where_it_shows(name):
    doc = " ".join((MUTANTS[name].__doc__ or "").split())
    assert "Visible" in doc, f"{name}: the docstring must say when the bug is visible"
    assert any(c in doc for c in SOURCES), (
        f"{name}: cite the public report (or say there is no single one)"
    )


def test_lse_of_low_precision_inputs_is_judged_at_float32():
    lo = tolerance.bound(
        "lse",
        "bf16",
        base_error=0.5,
        exact_absmax=100.0,
        world_size=4,
        lse_absmax=100.0,
        term_scale=30.0,
    )
    fp32 = tolerance.bound(
        "lse", "fp32", 0.0, 100.0, world_size=4, lse_absmax=100.0, term_scale=30.0
    )
    # ~20-bit units instead of float32's 23 (reduced-precision kernels use a 20-bit exp): at most
    # 16x
    assert fp32 < lo <= 16 * fp32
    assert lo < 0.03  # neither the low-precision base error (0.5) nor eps(bf16) * 100 widens it
    # other tensors keep the dtype's base term
    assert tolerance.bound("out", "bf16", 0.5, 1.0) > 1.0


POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_accumulator_fails_lse_where_the_reference_passes(pool, dtype):
    from harness.runner import run_case

    c = make_case(
        world_size=4,
        total_len=27,
        layout="zigzag",
        mask={"kind": "causal"},
        heads_q=4,
        heads_kv=2,
        head_dim=32,
        dtype=dtype,
        seed=14,
    )
    ref = run_case(c, pool, "reference")
    mut = run_case(c, pool, "mutant:low-precision-accumulator")
    assert ref.passed and ref.worst("lse") < 0.5
    assert mut.verdict == "silent-corruption" and mut.worst("lse") > 10


def test_dq_through_bf16_fails_dq_in_fp32(pool):
    from harness.runner import run_case

    c = make_case(world_size=2, total_len=8, heads_q=2, heads_kv=2, head_dim=16, seed=3)
    assert run_case(c, pool, "reference").passed
    mut = run_case(c, pool, "mutant:dq-through-bf16")
    assert [x.tensor for x in mut.failed_checks()] and {x.tensor for x in mut.failed_checks()} == {
        "dq"
    }


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_has_its_regression_case_in_the_corpus(name):
    from pathlib import Path

    from harness import case as case_mod
    from ring_impl.mutants.precision import GROWTH_ONLY

    # no single case shows it: the growth check is its witness (and must fail it)
    if name in GROWTH_ONLY:
        from tests.checks.test_growth import (
            test_correct_rings_pass_and_per_step_rounding_fails as t,
        )

        cases = {tuple(p) for m in t.pytestmark if m.name == "parametrize" for p in m.args[1]}
        assert (f"mutant:{name}", False) in cases, f"{name}: not in the growth check's test"
        return
    path = Path(__file__).resolve().parents[2] / "cases" / f"mutant-{name}.yaml"
    assert path.exists(), (
        f"no regression case for {name}: run `ring-harness selftest --only {name} --corpus cases`"
    )
    case, data = case_mod.load(path)
    assert case.impl == f"mutant:{name}" and case_mod.recorded_result(data)["verdict"] != "pass"
    comment = path.read_text().split("\nformat:")[0]
    assert comment.startswith(
        f"# {name}: regression case"
    ) and "reference it must pass" in comment.replace("\n# ", " ")


@pytest.mark.parametrize(
    "name",
    ["out-merge-in-input-dtype", "dq-accumulate-in-input-dtype", "dkv-travel-in-input-dtype"],
)
def test_per_step_rounding_mutants_are_the_reference_on_one_rank_and_for_fp32(name):
    """No merge, no accumulation over steps and no hop at W = 1 (the growth check's baseline), and
    rounding to fp32 is exact: they differ from the reference only in low precision on a ring."""
    import torch

    from ring_impl import ring_attention

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, do = (torch.randn(1, 9, 2, 8, generator=g).to(dtype) for _ in range(4))
        outs = []
        for fn in (ring_attention, MUTANTS[name]):
            qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
            out, lse = fn(qq, kk, vv, return_lse=True)
            out.backward(do)
            outs.append([out, lse, qq.grad, kk.grad, vv.grad])
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def _run(fn, length, head_dim, dtype, mask):
    import torch

    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, length, 2, head_dim, generator=g).to(dtype) for _ in range(4))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(qq, kk, vv, mask=mask, return_lse=True)
    out.backward(do)
    return [out, lse, qq.grad, kk.grad, vv.grad]


@pytest.mark.parametrize(
    "name, at_edge, past_edge",
    [
        (
            "tile-tail-dropped",
            (64, 32, "fp32"),
            (65, 32, "fp32"),
        ),  # one 64-key tile, then one key more
        # 0..256 exact; 259 rounds to 260
        ("positions-in-input-dtype", (257, 16, "bf16"), (260, 16, "bf16")),
        # the 64 kernel's head dims, then 80
        ("head-dim-dispatch-slip", (9, 64, "fp32"), (9, 80, "fp32")),
    ],
)
def test_scale_mutants_are_the_reference_up_to_their_edge_and_wrong_past_it(
    name, at_edge, past_edge
):
    """Why the toy check cannot see them: bit-identical to the reference while a rank holds <= 64
    tokens, every position is an exact bf16 integer and head_dim <= 64 (the battery, growth check
    and toy property sizes stay inside; tests/checks/test_scale_stage.py runs them), different one
    step past."""
    import torch

    from harness.dtypes import TORCH_DTYPES
    from ring_impl import ring_attention
    from ring_impl.masks import MaskSpec

    for (length, d, dt), same in ((at_edge, True), (past_edge, False)):
        ref, mut = (
            _run(fn, length, d, TORCH_DTYPES[dt], MaskSpec("causal"))
            for fn in (ring_attention, MUTANTS[name])
        )
        identical = all(torch.equal(a, b) for a, b in zip(ref, mut, strict=True))
        assert identical == same, (name, length, d, dt)
