"""How a model calls a ring: the `call` and the `inputs` form of a case (issue #40).

A training step is not the only call. Evaluation runs under `no_grad`, serving under
`inference_mode`, and activation checkpointing runs the forward twice: once without gradients,
once inside backward. Implementations branch on these, so each is a value of `Case.call`.

q, k and v rarely arrive as fresh contiguous tensors. They are views of one fused projection, or
transposed from (batch, heads, seq, dim). Each such form is a value of `Case.inputs`.

This module runs on the ranks. It imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

CALLS = ("train", "no-grad", "inference-mode", "checkpoint-reentrant", "checkpoint")
FORWARD_ONLY = ("no-grad", "inference-mode")
# calls whose leak run is a second backward through the first call's graph (retain_graph). The
# checkpointed calls rebuild their graph inside backward, so their leak run is a second call.
RETAINED_LEAK = ("train",)
INPUT_FORMS = ("contiguous", "fused-qkv", "transposed", "strided-dout")

Forward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]
]


def needs_backward(call: str) -> bool:
    """Whether the call runs a backward, so gradients are judged."""
    return call not in FORWARD_ONLY


def useful_form(call: str, form: str) -> str:
    """`form`, or contiguous where it would test nothing: a transposed dout in a call without a
    backward."""
    return "contiguous" if form == "strided-dout" and not needs_backward(call) else form


@dataclass
class Presented:
    """The tensors handed to the ring, and the leaves their gradients land in."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    leaves: tuple[torch.Tensor, ...]
    form: str
    slots: torch.Tensor | None = None  # paged KV: each local token's pool slot (harness.paged)

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """dq, dk, dv read from the leaves, in the ring's (batch, seq, heads, dim) layout."""
        if self.slots is not None:  # dk, dv read from the pools' gradients at the tokens' slots
            g = tuple(t.grad for t in self.leaves)
            return g[0], *(None if x is None else x.flatten(0, 1)[self.slots] for x in g[1:])
        if self.form == "fused-qkv":
            g = self.leaves[0].grad
            if g is None:
                return None, None, None
            hq, hkv = self.q.shape[2], self.k.shape[2]
            if g.dim() == 5:
                return g.unbind(2)
            if g.dim() == 3:  # a value head dim of its own: flat heads, split on the last dim
                parts = g.split([t.shape[2] * t.shape[3] for t in (self.q, self.k, self.v)], dim=2)
                qkv = (self.q, self.k, self.v)
                return tuple(p.view(t.shape) for p, t in zip(parts, qkv, strict=True))
            return g.split([hq, hkv, hkv], dim=2)
        grads = tuple(t.grad for t in self.leaves)
        if self.form == "transposed":
            return tuple(None if g is None else g.transpose(1, 2) for g in grads)
        return grads


def present(
    form: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, grad: bool
) -> Presented:
    """q, k, v (and dout) in `form`, with the same values as the contiguous shards given.

    fused-qkv: views of one buffer, `unbind` of (b, s, 3, h, d) when the head counts agree, else
    `split` of (b, s, hq + 2 hkv, d). transposed: views of (b, h, s, d) tensors. strided-dout: dout
    transposed the same way. With `grad`, the leaves require gradients, as a model's parameters'
    outputs do."""
    if form not in INPUT_FORMS:
        raise ValueError(f"unknown input form {form!r}")
    if form == "fused-qkv":
        if v.shape[3] != q.shape[3]:  # MLA: one projection, its heads flat, split on the last dim
            buf = torch.cat([t.flatten(2) for t in (q, k, v)], dim=2).requires_grad_(grad)
            sizes = [t.shape[2] * t.shape[3] for t in (q, k, v)]
            parts = buf.split(sizes, dim=2)
            views = [p.view(t.shape) for p, t in zip(parts, (q, k, v), strict=True)]
        elif q.shape[2] == k.shape[2]:
            buf = torch.stack([q, k, v], dim=2).requires_grad_(grad)
            views = buf.unbind(2)
        else:
            buf = torch.cat([q, k, v], dim=2).requires_grad_(grad)
            views = buf.split([q.shape[2], k.shape[2], v.shape[2]], dim=2)
        return Presented(*views, dout, (buf,), form)
    if form == "transposed":
        leaves = tuple(t.transpose(1, 2).contiguous().requires_grad_(grad) for t in (q, k, v))
        return Presented(*(t.transpose(1, 2) for t in leaves), dout, leaves, form)
    leaves = tuple(t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    return Presented(*leaves, present_dout(form, dout), leaves, form)


def present_dout(form: str, dout: torch.Tensor) -> torch.Tensor:
    """dout as `form` hands it to the backward: transposed for strided-dout, else as it is."""
    if form == "strided-dout":
        return dout.transpose(1, 2).contiguous().transpose(1, 2)
    return dout


def forward(
    call: str, fn: Forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of `fn(q, k, v)` called the way `call` says."""
    if call == "train":
        return fn(q, k, v)
    if call == "no-grad":
        with torch.no_grad():
            return fn(q, k, v)
    if call == "inference-mode":
        with torch.inference_mode():
            return fn(q, k, v)
    if call in ("checkpoint-reentrant", "checkpoint"):
        reentrant = call == "checkpoint-reentrant"
        return torch.utils.checkpoint.checkpoint(fn, q, k, v, use_reentrant=reentrant)
    raise ValueError(f"unknown call {call!r}")
