"""Point-to-point through host buffers, so that W ranks can share one GPU over gloo.

gloo cannot send or receive CUDA tensors, and NCCL refuses two ranks on one GPU. With staging on,
every P2P op the interposer posts goes through a host buffer, pinned for CUDA tensors. Messages
match per peer in posting order, and a batch is one Work, as under NCCL. The same code runs on CPU
tensors as an option, so CI exercises it. docs/gpu.md says how each op is staged, and what staging
hides compared with NCCL.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch

# the one tag of staged P2P: per-peer FIFO matching, as NCCL's
STAGED_TAG = 0


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous host tensor shaped like `t`: pinned when `t` is on a GPU."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


class StagedWork:
    """The transport's Work for a staged op. A receive's `wait` copies the host buffer into the
    user's tensor.
    """

    def __init__(self, real: Any, host: torch.Tensor, target: torch.Tensor | None = None) -> None:
        self.real = real
        # alive until the op completes (and, for a receive, its copy is queued)
        self.host = host
        self.target = target  # a receive's destination; None for a send
        self.landed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = self.real.wait(timeout) if timeout is not None else self.real.wait()
        if ok is not False:
            self._land()
        return ok

    def _land(self) -> None:
        if self.target is not None and not self.landed:
            # on the stream current at the wait; the caching host allocator keeps the pinned block
            # until the copy has run, so dropping `host` afterwards is safe
            self.target.copy_(self.host, non_blocking=self.target.is_cuda)
            self.landed = True

    def is_completed(self) -> bool:
        return bool(self.real.is_completed())

    def exception(self) -> Any:
        return self.real.exception()

    def _source_rank(self) -> int:
        return self.real._source_rank()


def post_send(post: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> StagedWork | None:
    """Copy `tensor` to a host buffer on the current stream, wait for that copy alone, then send."""
    host = host_buffer(tensor)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    if tensor.is_cuda:
        done = torch.cuda.Event()
        done.record()  # on the current stream, after the copy
        # this copy only: the device goes on with other work
        done.synchronize()
    real = post(host)  # contiguous by construction
    return None if real is None else StagedWork(real, host)


def post_recv(post: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> StagedWork | None:
    """Receive into a host buffer. The Work's wait copies it into `tensor`."""
    host = host_buffer(tensor)
    real = post(host)
    return None if real is None else StagedWork(real, host, tensor)


class BatchWork:
    """One Work for a whole `batch_isend_irecv`, as NCCL returns. wait() completes
    every op in it.
    """

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = [w for w in works if w is not None]

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        ok = True
        for w in self.works:
            ok = (w.wait(timeout) if timeout is not None else w.wait()) is not False and ok
        return ok

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return next((e for e in (w.exception() for w in self.works) if e is not None), None)

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return [t for w in self.works for t in w.result()]

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.result())
        return fut


# -- torch's functional collectives (funcol: DTensor, context_parallel, flex CP)
# ------------------------------ Seen on an H200 (docs/gpu/): funcol's all-gather of CUDA tensors on
# gloo kills both ranks with SIGSEGV, while dist.all_gather_into_tensor is right. These ops get a
# CUDA kernel that runs them on host copies.
FUNCTIONAL_OPS = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_out",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
)
# the registration, alive for the process
_LIBRARY: list[Any] = []


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(t, fn) for t in x)
    return x


def through_host(op: Any, device: torch.device) -> Callable[..., Any]:
    """`op` run on host copies of its tensor arguments and waited; its results moved back to
    `device`.
    """
    wait = torch.ops._c10d_functional.wait_tensor

    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = kwargs.pop("out", None)
        res = op(*_map_tensors(args, lambda t: t.cpu()), **kwargs)
        res = _map_tensors(res, lambda t: wait(t).to(device))
        # an _out variant: the result lands in the caller's tensor
        if out is not None:
            return out.copy_(res)
        return res

    return kernel


def stage_functional_collectives(device: torch.device) -> tuple[str, ...]:
    """Give torch's functional all-gather and reduce-scatter a CUDA kernel that runs on host copies.

    It acts process-wide, for a rank on `device` under --device cuda. It returns the ops it covered.
    """
    if _LIBRARY or device.type != "cuda":
        return ()
    ns = torch.ops._c10d_functional
    lib = torch.library.Library("_c10d_functional", "IMPL")
    done = []
    for name in FUNCTIONAL_OPS:
        base = name.removesuffix("_out")
        if not (hasattr(ns, name) and hasattr(ns, base)):
            continue  # not in this torch
        lib.impl(name, through_host(getattr(ns, base).default, device), "CUDA")
        done.append(name)
    _LIBRARY.append(lib)
    return tuple(done)
