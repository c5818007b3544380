"""Per-step-rounding mutants: the ring rounds a running result to the input dtype once per ring
step.

A correct ring rounds every term, partial result and output to the input dtype at most a fixed
number of times whatever W (ring size); these round the *running* accumulator once per step, so the
error grows with W (zhuzilin/ring-flash-attention#42: "backward error grows with world size"). For
fp32 inputs each is exact. The default check's single-W bound hardly sees them at W <= 4; the growth
check (harness/checks/stages/growth.py: the same global case at W = 1 and W = 2, 4, 8) does.

`low-precision-accumulator` (merges.py) is the out/lse member of the class: it keeps both out and
lse in the input dtype, and the float32 lse check kills it at W >= 2. `out-merge-in-input-dtype`
keeps lse in float32, so only the growth of out's error shows it. Rounding dout "per step" is no
mutant: dout arrives in the input dtype, so rounding it to that dtype changes no bit (an equivalent
mutant).

The RingParts seams see no input dtype where the accumulators live, so the kernels below note it
(`_Noted.dtype`, set by every block kernel call of this rank's ring before any merge or hop that
uses it).
"""

from __future__ import annotations

import torch

from ring_impl.comm import RingComm
from ring_impl.kernel import block_backward, block_forward
from ring_impl.merge import merge
from ring_impl.mutants.base import mutant
from ring_impl.ring import DKV_TAG, KVBlock

# killed by the growth check only: under the tolerance rule (a bound for every correct flash-style
# ring) no single case shows them, so their witness is harness/checks/stages/growth.py
# (tests/checks/test_growth.py), not a corpus case
GROWTH_ONLY = (
    "out-merge-in-input-dtype",
    "dq-accumulate-in-input-dtype",
    "dkv-travel-in-input-dtype",
)


class _Noted:
    """The input dtype of the block kernel's last call on this rank (one ring runs at a time per
    process)."""

    dtype: torch.dtype = torch.float32
    # the dq accumulator the ring holds (float32 sum of what we returned)
    dq_exact: torch.Tensor | None = None
    dq_low: torch.Tensor | None = None  # the same accumulator kept in the input dtype


def _round(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to the noted input dtype, in its own dtype."""
    return t.to(_Noted.dtype).to(t.dtype)


def noting_forward(q, *args, **kwargs):
    _Noted.dtype = q.dtype
    return block_forward(q, *args, **kwargs)


def merge_out_in_input_dtype(out, lse, block_out, block_lse):
    """The reference merge, then the merged out stored in the input dtype (lse stays float32)."""
    new_out, new_lse = merge(out, lse, block_out, block_lse)
    return _round(new_out), new_lse


def step_zero_resets(held: KVBlock, local: KVBlock) -> KVBlock:
    """The reference's block choice; at step 0 (the rank's own block) a new dq accumulator
    starts."""
    if held.owner == local.owner:
        _Noted.dq_exact = _Noted.dq_low = None
    return held


def dq_accumulated_in_input_dtype(dout, q, *args, **kwargs):
    """Block gradients whose float32 sum in the ring equals dq accumulated in the input dtype: the
    block's dq is added to a low-precision accumulator and the ring gets the accumulator's
    increment."""
    _Noted.dtype = q.dtype
    dq, dk, dv = block_backward(dout, q, *args, **kwargs)
    if _Noted.dq_low is None:
        _Noted.dq_exact = torch.zeros_like(dq)
        _Noted.dq_low = torch.zeros_like(dq)
    low = _round(_Noted.dq_low + dq)
    step = low - _Noted.dq_exact  # exact: both are values of the input dtype, close in magnitude
    _Noted.dq_low, _Noted.dq_exact = low, _Noted.dq_exact + step
    return step, dk, dv


def noting_backward(dout, q, *args, **kwargs):
    _Noted.dtype = q.dtype
    return block_backward(dout, q, *args, **kwargs)


class InputDtypeDkvComm(RingComm):
    """The dk/dv accumulators travel in the input dtype: each is rounded before every hop."""

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if self.tag == DKV_TAG:
            send.copy_(_round(send))
        super().exchange(send, recv)


out_merge_in_input_dtype = mutant(
    "out-merge-in-input-dtype",
    """Stores the merged out in the input dtype after every ring step while lse stays float32, as
    rings that merge into a bf16/fp16 output buffer do (the out half of ring-flash-attention's
    "Limits": low-precision accumulation; cf. zhuzilin/ring-flash-attention#42). Visible for
    fp16/bf16 inputs as out's error growing with W (the growth check, W = 8); exact for fp32.""",
    block_forward=noting_forward,
    merge=merge_out_in_input_dtype,
)

dq_accumulate_in_input_dtype = mutant(
    "dq-accumulate-in-input-dtype",
    """Accumulates dq over the ring steps in the input dtype (`dq += block_dq` on a bf16/fp16 tensor),
    the backward error that grows with world size of zhuzilin/ring-flash-attention#42. Visible for
    fp16/bf16 inputs as dq's error growing with W (the growth check); exact for fp32.""",
    backward_kv=step_zero_resets,
    block_backward=dq_accumulated_in_input_dtype,
)

dkv_travel_in_input_dtype = mutant(
    "dkv-travel-in-input-dtype",
    """The dk/dv accumulators travel the ring in the input dtype (rounded before every hop), as rings
    that send their dk/dv buffers in q.dtype do (zhuzilin/ring-flash-attention#42: backward error
    grows with world size). Visible for fp16/bf16 inputs as dk/dv errors growing with W (the growth
    check); exact for fp32.""",
    block_backward=noting_backward,
    comm=InputDtypeDkvComm,
)
