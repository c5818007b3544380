"""The flash-attn stand-in installed: install() in fresh interpreters, and the ring libraries on it.

install() is tested in subprocesses. The ring libraries run with the stand-in installed in this
process and removed again around each test. Their results are held to the bounds of
tests/helpers/flash_float64.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.kernels import flash_standin
from tests.helpers.flash_float64 import (
    backward,
    forward,
    fwd_bounds,
    grad_bounds,
    inputs,
    ref_mask,
    reference,
    within,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- install() in a fresh interpreter


def _python(code: str, extra_path: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(extra_path or []), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_install_puts_the_standin_first_when_flash_attn_is_absent():
    if flash_standin.kernel_label() not in ("none", "cpu-standin"):
        pytest.skip("a real flash-attn is installed here")
    stub_expected = not _installed("transformers")
    result = _python(f"""
        import sys
        from harness.kernels import flash_standin as fs
        assert fs.kernel_label() == "none", fs.kernel_label()
        assert fs.install() is True and sys.path[0] in (str(fs.STANDIN_DIR), str(fs.HF_STUB_DIR))
        assert fs.kernel_label() == "cpu-standin"
        import flash_attn  # without torch: flash_attn_func and flash_attn.flash_attn_interface load lazily
        assert flash_attn.__ring_harness_standin__ is True and flash_attn.__version__ == "2.8.3"
        assert flash_attn.__file__.startswith(str(fs.STANDIN_DIR)) and "torch" not in sys.modules
        assert fs.kernel_label() == "cpu-standin" and fs.install() is True
        assert sys.path.count(str(fs.STANDIN_DIR)) == 1
        import transformers  # the stub only where no real transformers is installed
        assert getattr(transformers, "__ring_harness_standin__", False) is {stub_expected}
        from transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10
        print("OK")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


def test_install_never_shadows_a_real_flash_attn(tmp_path):
    fake = tmp_path / "site" / "flash_attn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '2.7.4.post1'\n")
    result = _python(
        """
        import sys
        from harness.kernels import flash_standin as fs
        assert fs.kernel_label() == "flash-attn 2.7.4.post1", fs.kernel_label()
        assert fs.install() is False and str(fs.STANDIN_DIR) not in sys.path
        import flash_attn
        assert flash_attn.__version__ == "2.7.4.post1" and not hasattr(flash_attn, "__ring_harness_standin__")
        assert fs.install() is False and fs.kernel_label() == "flash-attn 2.7.4.post1"
        print("OK")
    """,
        extra_path=[str(tmp_path / "site")],
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


def test_standin_already_on_pythonpath_is_recognised():
    """Rank processes may get standin/ through PYTHONPATH: install() then inserts nothing more."""
    if flash_standin.kernel_label() not in ("none", "cpu-standin"):
        pytest.skip("a real flash-attn is installed here")
    result = _python(
        """
        import sys
        from harness.kernels import flash_standin as fs
        before = sys.path.count(str(fs.STANDIN_DIR))
        assert fs.kernel_label() == "cpu-standin" and fs.install() is True
        assert before == 1 and sys.path.count(str(fs.STANDIN_DIR)) == 1
        print("OK")
    """,
        extra_path=[str(flash_standin.STANDIN_DIR)],
    )
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr


# ---------------------------------------------------------------- the ring libraries on the
# stand-in


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture
def standin_world(tmp_path, monkeypatch):
    """The stand-in installed in this process and a one-rank gloo group; both removed afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    saved_path, saved_modules = list(sys.path), set(sys.modules)
    if not flash_standin.install():
        sys.path[:] = saved_path
        pytest.skip("a real flash-attn is installed here")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield monkeypatch
    dist.destroy_process_group()
    sys.path[:] = saved_path
    for name in set(sys.modules) - saved_modules:
        if name.split(".")[0] in ("flash_attn", "transformers", "ring_flash_attn", "yunchang"):
            del sys.modules[name]


def _self_ring(monkeypatch, ring_comm_class) -> None:
    """gloo cannot send a rank to itself; with one rank, RingComm's send/recv is a copy (the
    libraries always send dk/dv once at the end of their backward, even with world size 1)."""

    def send_recv(self, to_send, recv_tensor=None):
        res = torch.empty_like(to_send) if recv_tensor is None else recv_tensor
        return res.copy_(to_send)

    monkeypatch.setattr(ring_comm_class, "send_recv", send_recv)
    monkeypatch.setattr(ring_comm_class, "commit", lambda self: None)
    monkeypatch.setattr(ring_comm_class, "wait", lambda self: None)


def _run(func, q, k, v, dout, **kwargs):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = func(*leaves, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(dout)
    return out.detach(), *(x.grad for x in leaves)


def _check_against_standin_and_float64(got, q, k, v, dout, causal=True):
    out, lse, _, _ = forward(q, k, v, causal=causal)
    direct = (out, *backward(dout, q, k, v, out, lse, causal=causal)[:3])
    mask, scale = ref_mask(q.shape[1], k.shape[1], causal), q.shape[-1] ** -0.5
    out64, lse64, p, *grads64 = reference(q, k, v, dout, mask, scale)
    tol_out, tol_lse, a_max = fwd_bounds(q, k, v, mask, scale, lse64)
    bounds = (tol_out, *grad_bounds(q, k, v, dout, out, lse, out64, lse64, p, scale, a_max))
    assert all(within(x, r, bd) for x, r, bd in zip(got, (out64, *grads64), bounds, strict=True))
    return direct


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_runs_on_the_standin(standin_world):
    import ring_flash_attn
    from ring_flash_attn import utils

    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.bfloat16, 1, 32, 32, 4, 2, 16, seed=17)
    for func in (ring_flash_attn.ring_flash_attn_func, ring_flash_attn.zigzag_ring_flash_attn_func):
        got = _run(func, q, k, v, dout, causal=True)
        direct = _check_against_standin_and_float64(got, q, k, v, dout)
        # one rank: one kernel call
        assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_llama3_varlen_on_the_standin(standin_world):
    import torch.distributed as dist
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    cu = torch.tensor([0, 10, 30, 48], dtype=torch.int32)
    q, k, v, dout = (x[0] for x in inputs(torch.float16, 1, 48, 48, 4, 2, 16, seed=19))
    cu_q, cu_k, max_q, max_k, local_k = llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 1)
    got = _run(
        llama3_flash_attn_varlen_func,
        q,
        k,
        v,
        dout,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        heads_k_stride=1,
        local_k_slice=local_k,
        causal=True,
        group=dist.group.WORLD,
    )
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [x[rows].unsqueeze(0) for x in (q, k, v, dout)]
        _check_against_standin_and_float64([x[rows].unsqueeze(0) for x in got], *one)


@pytest.mark.extra
@pytest.mark.skipif(not _installed("ring_flash_attn"), reason="ring-flash-attn is not installed")
def test_ring_flash_attn_0_1_8_rounds_fp16_dq_through_bf16(standin_world):
    """ring_flash_attn.py:154 (0.1.8) returns `dq.to(torch.bfloat16)`; autograd casts it back to
    fp16."""
    import importlib.metadata

    import ring_flash_attn
    from ring_flash_attn import utils

    if importlib.metadata.version("ring-flash-attn") != "0.1.8":
        pytest.skip("pins a bug of ring-flash-attn 0.1.8")
    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.float16, 1, 32, 32, 2, 2, 16, seed=23)
    got = _run(ring_flash_attn.ring_flash_attn_func, q, k, v, dout, causal=True)
    out, lse, _, _ = forward(q, k, v, causal=True)
    dq = backward(dout, q, k, v, out, lse, causal=True)[0]
    assert torch.equal(got[1], dq.to(torch.bfloat16).to(torch.float16)) and not torch.equal(
        got[1], dq
    )


@pytest.mark.extra
@pytest.mark.skipif(not _installed("yunchang"), reason="yunchang is not installed")
def test_yunchang_ring_runs_on_the_standin(standin_world):
    from yunchang.ring import ring_flash_attn_func, utils, zigzag_ring_flash_attn_func

    _self_ring(standin_world, utils.RingComm)
    q, k, v, dout = inputs(torch.bfloat16, 1, 32, 32, 4, 2, 16, seed=29)
    for func in (ring_flash_attn_func, zigzag_ring_flash_attn_func):
        got = _run(func, q, k, v, dout, causal=True)
        direct = _check_against_standin_and_float64(got, q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))


@pytest.mark.extra
@pytest.mark.skipif(not _installed("yunchang"), reason="yunchang is not installed")
def test_yunchang_0_6_4_varlen_ring_predates_flash_attn_2_6(standin_world):
    """yunchang/ring/ring_flash_attn_varlen.py calls _flash_attn_varlen_forward(...,
    window_size=...) and unpacks 8 outputs: flash-attn < 2.6 signatures, which 2.8.3 (and so the
    stand-in) does not accept."""
    from yunchang.ring import ring_flash_attn_varlen_func

    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    q, k, v, _ = (x[0] for x in inputs(torch.bfloat16, 1, 32, 32, 2, 2, 16))
    with pytest.raises(TypeError, match="window_size"):
        ring_flash_attn_varlen_func(q, k, v, cu, 16, causal=True)
