"""Functional collectives under the interposer: torch's `_c10d_functional` ops and their waits.

torch's own rings, DTensor and `torch.distributed._functional_collectives` skip the c10d Python
calls that `wrappers` replaces. They call `torch.ops._c10d_functional.<op>` by attribute, and every
wait (an AsyncCollectiveTensor's first use, `.wait()`, `wait_tensor`) ends in
`torch.ops._c10d_functional.wait_tensor`. `hooked(ip)` puts callables on that namespace for a case.
Each op is then logged and faulted as an async c10d collective is (harness.faults.collectives): the
wait_tensor of its output is its wait. torch 2.13 registers the ops' backward in Python, so the
backward's collectives are seen too; an op dispatched from C++ is not. Runs inside a rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map_only

from harness.faults import inject
from harness.faults.collectives import drop, group_ranks
from harness.faults.schema import FaultSpec
from harness.faults.work import FaultWork

if TYPE_CHECKING:
    from harness.faults.interpose import Interposer

NAMESPACE = "_c10d_functional"
OPS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "all_reduce_",
    "all_reduce_coalesced_",
    "broadcast_",
)
INPLACE = frozenset({"all_reduce_", "all_reduce_coalesced_", "broadcast_"})  # output = input


class _Hook:
    """Stands in for one OpOverloadPacket: a call goes to `fn`, an attribute to the packet."""

    def __init__(self, packet: Any, fn: Any) -> None:
        self._packet, self._fn = packet, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


class _Held(torch.autograd.Function):
    """early-read: a NaN stand-in for an op's output until its wait; the gradient goes through."""

    @staticmethod
    def forward(ctx: Any, real: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(real)
        inject.poison(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Real:
    """The real op's outputs, as FaultWork.real: wait() is their wait_tensor.

    wait_tensor takes no timeout: the group's own (within the case deadline) bounds it.
    """

    def __init__(self, wait: Any, tensors: Sequence[torch.Tensor]) -> None:
        self._wait, self.tensors = wait, list(tensors)

    def wait(self, timeout: Any = None) -> bool:
        for t in self.tensors:
            self._wait(t)
        return True

    def is_completed(self) -> bool:
        return False

    def exception(self) -> Any:
        return None


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in x if isinstance(t, torch.Tensor)] if isinstance(x, (list, tuple)) else []


def _like(x: Any, tensors: list[torch.Tensor]) -> Any:
    """`tensors` in the form of `x`: one tensor, or a list."""
    return tensors[0] if isinstance(x, torch.Tensor) else list(tensors)


def _placeholder(packet: Any, args: tuple, kwargs: dict) -> Any:
    """A dropped op's output: NaN of the shape the op would return (from its meta kernel)."""
    device = _tensors(args[0])[0].device

    def real(m: torch.Tensor) -> torch.Tensor:
        out = torch.empty(m.shape, dtype=m.dtype, device=device)
        inject.poison(out)
        return out

    meta = packet(*tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), args), **kwargs)
    return tree_map_only(torch.Tensor, real, meta)


def _reuse(
    ip: Interposer, fw: FaultWork, specs: Sequence[FaultSpec], args: tuple
) -> tuple[Any, ...]:
    """send-reuse: the op reads copies of its inputs (gradients still flow); the caller's are
    watched until the wait. Returns the arguments to call the op with."""
    ins = _tensors(args[0])
    copies = [t.clone() for t in ins]
    ip.watch_buffers(fw.op, [(t, c.detach()) for t, c in zip(ins, copies, strict=True)])
    fw.after.append(lambda: ip.unwatch(fw.op.index))
    ip.schedule.fire(specs)
    return (_like(args[0], copies), *args[1:])


def run(ip: Interposer, name: str, packet: Any, wait: Any, args: tuple, kwargs: dict) -> Any:
    """One functional collective: log it, post it (or not: drop), hand back its output(s)."""
    if ip.nested:
        return packet(*args, **kwargs)
    inplace = name in INPLACE
    ip.flush()
    t_open = time.monotonic()
    peers = group_ranks(ip, kwargs.get("group_name", args[-1]))
    op, hits, hold = ip.open_op(name, "collective", None, _tensors(args[0]), peers, not inplace)
    fw = FaultWork(ip, op, hold=hold)
    ip.pending[op.index] = op
    if "drop" in hits:
        drop(ip, fw, hits["drop"])
        out = _placeholder(packet, args, kwargs)
    else:
        call = (
            _reuse(ip, fw, hits["send-reuse"], args)
            if "send-reuse" in hits and not inplace
            else args
        )
        ip.nested = ip.in_hook = True
        try:
            real = packet(*call, **kwargs)
        finally:
            ip.nested = ip.in_hook = False
        fw.real = _Real(wait, _tensors(real))
        out = real
        if "early-read" in hits and not inplace:
            held = [_Held.apply(t) for t in fw.real.tensors]
            out = _like(real, held)
            fw.after.append(lambda: _deliver(held, fw.real.tensors))
            ip.schedule.fire(hits["early-read"])
        if "corrupt" in hits:
            corrupt = ip.schedule.corrupter(hits["corrupt"], op)
            first = _tensors(out)[0]
            fw.after.append(lambda: _no_grad(corrupt, first))
    fw.outputs = _tensors(out)
    for t in fw.outputs:
        ip.inflight[id(t)] = (t, fw)
    ip.close_op(t_open)
    return out


def _deliver(held: list[torch.Tensor], reals: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for h, r in zip(held, reals, strict=True):
            h.copy_(r)


def _no_grad(fn: Any, t: torch.Tensor) -> None:
    with torch.no_grad():
        fn(t)


def wait_tensor(ip: Interposer, wait: Any, tensor: torch.Tensor) -> torch.Tensor:
    """The wait of a hooked op's output completes its FaultWork; any other tensor waits as usual."""
    entry = ip.inflight.get(id(tensor))
    if entry is not None and entry[0] is tensor:
        del ip.inflight[id(tensor)]
        ip.complete(entry[1])
    return wait(tensor)  # a tensor already waited returns as it is


@contextlib.contextmanager
def hooked(ip: Interposer) -> Iterator[None]:
    """Replace the functional ops and wait_tensor on torch.ops._c10d_functional for one case."""
    ns = getattr(torch.ops, NAMESPACE)
    saved: dict[str, Any] = {}
    for name in (*OPS, "wait_tensor"):
        try:
            saved[name] = getattr(ns, name)
        except (AttributeError, RuntimeError):  # not in this torch
            continue
    wait = saved.get("wait_tensor")
    if wait is None:
        yield
        return
    try:
        for name, packet in saved.items():
            if name == "wait_tensor":
                fn = lambda t, _w=packet: wait_tensor(ip, _w, t)  # noqa: E731
            else:
                fn = lambda *a, _n=name, _p=packet, **k: run(ip, _n, _p, wait, a, k)  # noqa: E731
            setattr(ns, name, _Hook(packet, fn))
        yield
    finally:
        for name, packet in saved.items():
            setattr(ns, name, packet)
