"""ring-flash-attn and yunchang, unmodified, on the harness's gloo pool with the flash-attn CPU
stand-in.

One small case per adapter end to end (the ranks install the stand-in, import the library, run
forward and backward; the parent judges against float64), plus the library bugs the harness reports,
pinned to the versions CI installs (ci/requirements-thirdparty.txt). Each test is skipped, with one
line, when its library is not importable, or when a real flash-attn is (then the adapters declare
NCCL only and gloo ranks never get the stand-in).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from harness.case import make_case
from harness.kernels import flash_standin
from harness.result import result_record
from harness.runner import run_case
from ring_impl.masks import Expr, MaskSpec, and_, prim

# the pinned ring-flash-attn and yunchang (CI's extras step: docs/ci.md)
pytestmark = pytest.mark.extra
CAUSAL, NONE = MaskSpec("causal"), MaskSpec("none")
PINNED = {"ring_flash_attn": ("ring-flash-attn", "0.1.8"), "yunchang": ("yunchang", "0.6.4")}


def _library(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(
            f"{PINNED[module][0]} is not installed (pip install --no-deps -r "
            "ci/requirements-thirdparty.txt)"
        )
    if not flash_standin.serves_gloo():
        pytest.skip("a real flash-attn is installed here: the flash-attn adapters run on NCCL only")


def _pinned(module: str) -> None:
    dist, version = PINNED[module]
    if importlib.metadata.version(dist) != version:
        pytest.skip(f"pins a bug of {dist} {version}")


POOL_SIZE = 4  # ranks of the module's `pool` (tests/conftest.py)


def _case(impl: str, **kw):
    base = dict(
        world_size=2,
        seq_lens=(8, 8),
        heads_q=4,
        heads_kv=2,
        head_dim=16,
        layout="contiguous",
        mask=CAUSAL,
        dtype="bf16",
        seed=3,
        impl=impl,
        deadline_s=60.0,
    )
    return make_case(**{**base, **kw})


def _explain(res) -> str:
    return f"{res.impl} {res.case.summary()}: {res.verdict} {res.detail}"


PASSING = {
    "ring-flash-attn": ("ring_flash_attn", dict(mask=NONE)),
    "ring-flash-attn-zigzag": (
        "ring_flash_attn",
        dict(layout="zigzag", world_size=3, seq_lens=(6, 6, 6)),
    ),
    "ring-flash-attn-stripe": ("ring_flash_attn", dict(layout="striped", dtype="fp16")),
    "ring-flash-attn-llama3": (
        "ring_flash_attn",
        dict(mask=MaskSpec("document", doc_starts=(0, 5, 11))),
    ),
    "yunchang-ring": ("yunchang", dict(layout="zigzag")),
    "yunchang-ulysses": ("yunchang", dict(mask=MaskSpec("window", window=3))),
    "yunchang-usp": ("yunchang", dict(world_size=4, seq_lens=(4, 4, 4, 4))),
}


@pytest.mark.parametrize("impl", list(PASSING))
def test_adapter_runs_on_the_standin_and_passes(pool, impl):
    module, kw = PASSING[impl]
    _library(module)
    res = run_case(_case(impl, **kw), pool)
    assert res.passed, _explain(res)
    assert res.extra.get("kernel") == flash_standin.STANDIN_LABEL
    assert result_record(res)["versions"]["kernel"] == "cpu-standin"
    assert {c.tensor for c in res.checks} >= {"out", "dq", "dk", "dv"}


# masks of the language each flash-attn adapter maps (`_common.flash_mask`): documents that straddle
# the ranks with a causal window inside each, a per-document window, a two-sided window where every
# rank sees the whole sequence (Ulysses); and one it must refuse with one line (llama3 and a
# two-sided window)
MASK_LANGUAGE = {
    "llama3 document & window": (
        "ring-flash-attn-llama3",
        and_(prim("document", (0, 5, 11)), prim("window", 3, 0)),
    ),
    "llama3 per-document window": (
        "ring-flash-attn-llama3",
        Expr("per-document", ((0, 7),), (prim("window", 2, 0),)),
    ),
    "ulysses two-sided window": ("yunchang-ulysses", prim("window", 3, 2)),
    "ulysses window & causal": ("yunchang-ulysses", and_(prim("window", 9, 2), prim("causal"))),
}


@pytest.mark.parametrize("label", list(MASK_LANGUAGE))
def test_flash_adapters_run_the_mask_language_they_map(pool, label):
    impl, expr = MASK_LANGUAGE[label]
    _library("yunchang" if impl.startswith("yunchang") else "ring_flash_attn")
    res = run_case(_case(impl, mask=MaskSpec.of(expr)), pool)
    assert res.passed and {c.tensor for c in res.checks} >= {"out", "dq", "dk", "dv"}, _explain(res)


def test_llama3_refuses_a_two_sided_window_with_one_line(pool):
    _library("ring_flash_attn")
    res = run_case(_case("ring-flash-attn-llama3", mask=MaskSpec.of(prim("window", 3, 2))), pool)
    assert res.verdict == "fail-stop" and "unsupported here: mask window-right" in res.detail, (
        _explain(res)
    )


def test_undeclared_dtype_is_refused_with_one_line(pool):
    _library("ring_flash_attn")
    res = run_case(_case("ring-flash-attn", dtype="fp32"), pool)
    assert res.verdict == "fail-stop" and "unsupported here: dtype fp32" in res.detail, _explain(
        res
    )


@pytest.mark.parametrize(
    "impl, module", [("ring-flash-attn-zigzag", "ring_flash_attn"), ("yunchang-ring", "yunchang")]
)
def test_zigzag_with_an_odd_local_length_is_accepted_silently(pool, impl, module):
    """Forward splits a rank's tokens at L//2, backward with chunk(2): for L = 3 the backward's `+=`
    broadcasts a 1-row block over 2 rows, so every rank completes with wrong numbers
    (cases/<lib>-zigzag-odd-local-length.yaml)."""
    _library(module)
    _pinned(module)
    res = run_case(_case(impl, layout="zigzag", seq_lens=(3, 3)), pool)
    assert res.verdict == "silent-corruption", _explain(res)
    assert {"dq", "out"} <= {c.tensor for c in res.failed_checks()}
    assert run_case(_case("reference", layout="zigzag", seq_lens=(3, 3)), pool).passed


def test_zigzag_with_five_tokens_per_rank_raises_in_backward(pool):
    _library("ring_flash_attn")
    _pinned("ring_flash_attn")
    res = run_case(
        _case("ring-flash-attn-zigzag", layout="zigzag", seq_lens=(5, 5), deadline_s=30.0), pool
    )
    assert res.verdict == "fail-stop", _explain(res)
    assert "zigzag_ring_flash_attn_backward" in res.detail and "must match the size" in res.detail
