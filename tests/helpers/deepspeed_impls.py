"""DeepSpeed variants for the tests: Ulysses as a caller who never registers a sequence-parallel
mesh uses it (`no_mesh`), and FPDT with its online-softmax merge made overflow-free
(`fpdt_stable_merge`)."""

from __future__ import annotations

from harness.context import Impl
from harness.impls.adapters import deepspeed as ds
from harness.impls.adapters import deepspeed_fpdt

_inner = ds.make("deepspeed-ulysses")


def _run(q, k, v, ctx):
    from deepspeed.utils import groups

    ds.init_deepspeed(ctx.group)
    groups.mpu = None  # DistributedAttention called directly, without deepspeed.initialize(mpu=...)
    registered = ds.init_deepspeed
    ds.init_deepspeed = lambda group: None  # the adapter's run would register it again
    try:
        return _inner.run(q, k, v, ctx)
    finally:
        ds.init_deepspeed = registered


no_mesh = Impl("deepspeed-ulysses-no-mesh", _run, capabilities=_inner.capabilities)


def _stable_update(out, lse, block_out, block_lse):
    """FPDT's `_update_out_and_lse` with the overflow-free merge (new lse = lse - logsigmoid(lse -
    block lse)): the same sum of the two softmax-weighted parts, never exp of a positive gap."""
    import torch

    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    return out, lse - torch.nn.functional.logsigmoid(lse - block_lse)


_fpdt = deepspeed_fpdt.make("deepspeed-fpdt")


def _fpdt_stable_run(q, k, v, ctx):
    from deepspeed.sequence import fpdt_layer

    shipped = fpdt_layer._update_out_and_lse
    fpdt_layer._update_out_and_lse = _stable_update
    try:
        return _fpdt.run(q, k, v, ctx)
    finally:
        fpdt_layer._update_out_and_lse = shipped


# DeepSpeed FPDT with its online-softmax merge made overflow-free, the rest unmodified (the
# capabilities are the built-in adapter's, without importing deepspeed here)
fpdt_stable_merge = Impl(
    "deepspeed-fpdt-stable-merge", _fpdt_stable_run, capabilities=deepspeed_fpdt.CAPABILITIES
)
