"""DeepSpeed's Ulysses as a caller who never registers a sequence-parallel mesh with DeepSpeed uses it: the
built-in adapter (harness.impls.adapters.deepspeed) minus the `groups.mpu` registration."""

from __future__ import annotations

from harness.context import Impl
from harness.impls.adapters import deepspeed as ds

_inner = ds.make("deepspeed-ulysses")


def _run(q, k, v, ctx):
    from deepspeed.utils import groups

    ds._init_deepspeed(ctx.group)
    groups.mpu = None  # DistributedAttention called directly, without deepspeed.initialize(mpu=...)
    registered = ds._init_deepspeed
    ds._init_deepspeed = lambda group: None  # the adapter's run would register it again
    try:
        return _inner.run(q, k, v, ctx)
    finally:
        ds._init_deepspeed = registered


no_mesh = Impl("deepspeed-ulysses-no-mesh", _run, capabilities=_inner.capabilities)
