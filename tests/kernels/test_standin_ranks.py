"""Where the flash-attn CPU stand-in is installed: only in gloo rank processes, only where no real
flash-attn is importable, never shadowing one; and how a run says so (the ranks' `kernel` reply,
`versions: kernel` in a saved case, the flash-attn adapters' declared backend, `ring-harness
impls`).

A real flash-attn is simulated by a package `flash_attn` (version 2.7.4.post1, none of its
functions) first on PYTHONPATH: of the parent in a subprocess, of the ranks through the pool's
environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.case import make_case
from harness.impls import registry
from harness.kernels import flash_standin
from harness.ranks.pool import RankPool
from harness.result import CaseResult, Verdict, result_record
from harness.runner import run_case
from ring_impl.masks import MaskSpec

ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.kernels.standin_probe:impl"
FLASH_ADAPTERS = (
    "ring-flash-attn",
    "ring-flash-attn-zigzag",
    "ring-flash-attn-stripe",
    "ring-flash-attn-llama3",
    "yunchang-ring",
    "yunchang-ulysses",
    "yunchang-usp",
    "deepspeed-fpdt",
)
needs_no_real_flash = pytest.mark.skipif(
    not flash_standin.serves_gloo(), reason="a real flash-attn is installed here"
)


@pytest.fixture
def fake_flash(tmp_path) -> Path:
    """A folder holding a 'real' flash-attn 2.7.4.post1 (a package that is not ours)."""
    pkg = tmp_path / "site" / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '2.7.4.post1'\n")
    return pkg.parent


def _python(code: str, extra_path: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra_path, str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_real_flash_attn_makes_the_adapters_nccl_only(fake_flash):
    result = _python(
        """
        import sys
        from harness.impls import registry
        from harness.impls.adapters import _common
        from harness.kernels import flash_standin as fs
        assert not fs.serves_gloo() and fs.real_flash_attn()
        assert fs.rank_label("gloo") == fs.rank_label("nccl") == "flash-attn 2.7.4.post1"
        assert _common.flash_devices() == {"cuda"}
        for name in ("ring-flash-attn", "ring-flash-attn-zigzag", "yunchang-ring", "yunchang-usp"):
            caps = registry.declared_capabilities(name)
            assert caps.devices == {"cuda"} and caps.world_sizes[0] in (1, 4), (name, caps)
        rows = {r["name"]: r for r in registry.describe()}
        assert rows["ring-flash-attn"]["kernel"] == "flash-attn 2.7.4.post1"
        assert str(fs.STANDIN_DIR) not in sys.path and str(fs.HF_STUB_DIR) not in sys.path
        print("OK")
    """,
        [str(fake_flash)],
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


@needs_no_real_flash
def test_without_one_the_adapters_declare_gloo_and_the_parent_installs_nothing():
    from harness.impls.adapters import _common

    assert (
        flash_standin.rank_label("gloo") == "cpu-standin"
        and flash_standin.rank_label("nccl") == "none"
    )
    assert _common.flash_devices() == {"cpu"}
    for name in FLASH_ADAPTERS:
        caps = registry.declared_capabilities(name)
        assert caps.devices == {"cpu"} and caps.dtypes == {"fp16", "bf16"}, name
        assert caps.head_dims == tuple(range(8, 257, 8)) and not caps.uneven, name
    # a ring that sends itself its dk/dv at W=1 starts at W=2 on gloo; llama3 (all-gather) and
    # Ulysses do not
    assert registry.declared_capabilities("ring-flash-attn").world_sizes == (2, 8)
    assert registry.declared_capabilities("yunchang-ring").world_sizes == (2, 8)
    assert registry.declared_capabilities("ring-flash-attn-llama3").world_sizes == (1, 8)
    assert registry.declared_capabilities("yunchang-ulysses").world_sizes == (1, 8)
    assert registry.declared_capabilities("yunchang-usp").world_sizes == (4, 8)
    for name in ("ring-flash-attn-zigzag", "ring-flash-attn-stripe"):
        assert registry.declared_capabilities(name).masks == {"causal"}
    assert str(flash_standin.STANDIN_DIR) not in sys.path and "flash_attn" not in sys.modules


@needs_no_real_flash
def test_impls_lists_the_kernel_of_the_flash_attn_adapters_only(capsys):
    rows = {r["name"]: r for r in registry.describe()}
    assert {n for n, r in rows.items() if "kernel" in r} == set(FLASH_ADAPTERS)
    assert all(rows[n]["kernel"] == "cpu-standin" for n in FLASH_ADAPTERS)
    from harness.commands import impls

    impls.run(impls_args())
    lines = capsys.readouterr().out.splitlines()
    for name in FLASH_ADAPTERS:
        line = next(ln for ln in lines if ln.startswith(name + " "))
        assert line.endswith("kernel: cpu-standin") and "[cpu]" in line, line
    assert not any("kernel:" in ln for ln in lines if ln.startswith("reference "))


def impls_args():
    import argparse

    return argparse.Namespace(json=False, mutants=False)


def _probe_case(**kw):
    return make_case(
        **{
            **dict(
                world_size=1,
                seq_lens=(12,),
                heads_q=4,
                heads_kv=2,
                head_dim=16,
                layout="contiguous",
                mask=MaskSpec("causal"),
                dtype="bf16",
                seed=7,
                impl=PROBE,
                deadline_s=60.0,
            ),
            **kw,
        }
    )


@needs_no_real_flash
def test_gloo_ranks_install_the_standin_and_report_it():
    with RankPool(size=1) as pool:
        res = run_case(_probe_case(), pool, allow_import=True)
        ref = run_case(_probe_case(impl="reference"), pool)
    assert res.passed, f"{res.verdict} {res.detail}"
    assert (
        res.extra["kernel"] == "cpu-standin"
        and result_record(res)["versions"]["kernel"] == "cpu-standin"
    )
    assert (
        ref.passed and "kernel" not in ref.extra and "kernel" not in result_record(ref)["versions"]
    )
    # installed in the rank processes only
    assert str(flash_standin.STANDIN_DIR) not in sys.path and "flash_attn" not in sys.modules


def test_gloo_ranks_never_shadow_a_real_flash_attn(fake_flash, monkeypatch):
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(fake_flash), os.environ.get("PYTHONPATH")]))
    )
    with RankPool(size=1) as pool:
        res = run_case(_probe_case(), pool, allow_import=True)
    assert res.extra["kernel"] == "flash-attn 2.7.4.post1"
    # the fake has none
    assert res.verdict == Verdict.FAIL_STOP and "flash_attn_func" in res.detail, res.detail


def test_result_record_adds_the_kernel_only_when_the_ranks_reported_one():
    case = _probe_case(impl="reference")
    plain = CaseResult(case=case, impl="reference", verdict=Verdict.PASS)
    assert "kernel" not in result_record(plain)["versions"]
    flash = CaseResult(
        case=case, impl="ring-flash-attn", verdict=Verdict.PASS, extra={"kernel": "cpu-standin"}
    )
    assert result_record(flash, "0.1.8")["versions"] == {
        **result_record(plain, "0.1.8")["versions"],
        "kernel": "cpu-standin",
    }
