"""Localisation probes: the implementation under test re-run on the same case with its values kept
on one key block, or its output gradient kept on one query block.

Attention is linear in V and its gradients are linear in dout, so these runs split the error
exactly: out = sum over key blocks b of out(V kept on b), and dk/dv = sum over query blocks a of
dk/dv(dout kept on a). A block is one rank's shard (what the ring passes at each step).

A probe is loaded in the ranks by name (`harness.impls.probe:p_<hex>`, resolved with allow_import),
so the pool and worker need no changes; the name encodes (inner implementation, kind, block).
"""

from __future__ import annotations

import json
from functools import cache

import torch

from harness.context import Impl, RunContext

KINDS = ("kv", "q")  # kv: keep V on key block `block`; q: keep dout on query block `block`


def spec(inner: str, kind: str, block: int) -> str:
    """The implementation name of a probe of `inner`."""
    if kind not in KINDS:
        raise ValueError(f"unknown probe kind {kind!r}")
    return f"harness.impls.probe:p_{json.dumps([inner, kind, int(block)]).encode().hex()}"


@cache
def _inner(name: str) -> Impl:
    from harness.impls import registry

    return registry.resolve(name, allow_import=registry.is_module_path(name))


def _split(res):
    return (res[0], res[1]) if isinstance(res, (tuple, list)) else (res, None)


def _probe(inner: str, kind: str, block: int) -> Impl:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext):
        impl = _inner(inner)
        if kind == "kv":
            return impl.run(q, k, v if ctx.rank == block else v * 0, ctx)
        out, lse = _split(impl.run(q, k, v, ctx))
        # same forward value, zero gradient: backward still runs on every rank
        if ctx.rank != block:
            out = out.detach() + out * 0
        return out if lse is None else (out, lse)

    return Impl(f"probe-{kind}{block}[{inner}]", run)


def __getattr__(name: str) -> Impl:
    """Module attribute `p_<hex>` -> the probe it encodes (how a worker resolves a probe name)."""
    if not name.startswith("p_"):
        raise AttributeError(name)
    try:
        inner, kind, block = json.loads(bytes.fromhex(name[2:]).decode())
    except (ValueError, UnicodeDecodeError):
        raise AttributeError(name) from None
    return _probe(inner, kind, int(block))
