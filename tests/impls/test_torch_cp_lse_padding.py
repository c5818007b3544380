"""Why `torch-cp` declares fp16/bf16 with flash head dims only: torch's ring merger and the
memory-efficient kernel's padded lse, shown on CPU with torch's own code (the CUDA kernels cannot
run here).

SDPA sends fp32 (and head dims flash refuses) to `aten._scaled_dot_product_efficient_attention`,
whose lse is (B, H, ceil(L/32)*32) on CUDA (its meta function says so; HIP builds excepted), while
the flash op's lse is (B, H, L). torch's ring merges block results with `_SDPAMerger`, which
unsqueezes the lse to (B, H, Lpad, 1) and combines it with outputs (B, H, L, D): from the second
ring step on that raises, or for L == 1 silently grows out to 32 rows. See docs/third-party.md,
"torch-cp".
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.impls import registry
from harness.impls.adapters._common import FLASH_HEAD_DIMS

attention = pytest.importorskip(
    "torch.distributed.tensor.experimental._context_parallel._attention"
)
Merger = getattr(attention, "_SDPAMerger", None)
needs_merger = pytest.mark.skipif(Merger is None, reason="this torch has no _SDPAMerger")
not_hip = pytest.mark.skipif(
    bool(torch.version.hip), reason="ROCm's efficient kernel returns an unpadded lse"
)


@not_hip
@pytest.mark.parametrize("length", [1, 5, 32, 33])
def test_efficient_lse_is_padded_to_32_and_flash_lse_is_not(length):
    q = torch.empty(1, 2, length, 16, device="meta")
    lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[1]
    assert lse.shape == (1, 2, math.ceil(length / 32) * 32)
    h = q.to(torch.float16)
    assert torch.ops.aten._scaled_dot_product_flash_attention(h, h, h)[1].shape == (1, 2, length)


def _merge(length: int, padded: int) -> torch.Tensor:
    merger = Merger(True, seq_dim=2)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # two ring steps
        merger.step(
            torch.randn(1, 2, length, 4, generator=g), torch.randn(1, 2, padded, generator=g), False
        )
    return merger.results()[0]


@needs_merger
def test_merger_raises_on_a_padded_lse():
    with pytest.raises(RuntimeError, match="must match the size"):
        _merge(5, 32)


@needs_merger
def test_merger_grows_a_one_token_output_to_the_padded_length():
    assert _merge(1, 32).shape == (1, 2, 32, 4)


@needs_merger
def test_merger_is_fine_with_unpadded_lse():
    assert _merge(5, 5).shape == (1, 2, 5, 4) and _merge(32, 32).shape == (1, 2, 32, 4)


@pytest.mark.parametrize("name", ["torch-cp", "torch-cp-alltoall"])
def test_torch_cp_declares_only_what_the_flash_kernel_takes(name):
    caps = registry.declared_capabilities(name)
    assert caps.dtypes == {"fp16", "bf16"} and caps.head_dims == FLASH_HEAD_DIMS
    assert caps.layouts == {"contiguous", "zigzag"} and caps.masks == {"none", "causal"}
    assert caps.devices == {"cuda"} and not caps.gqa
