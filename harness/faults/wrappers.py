"""The functions the interposer puts in place of torch.distributed's, for the duration of a case.

Point-to-point calls (isend, irecv, send, recv, batch_isend_irecv) go to the interposer's
post_send / post_recv and complete through its FaultWork; every collective in `COLLECTIVE_ARGS`
is bound by argument name and goes to Interposer.collective. `originals()` is what they replace.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed.distributed_c10d as c10d

from harness.faults.staging import BatchWork

if TYPE_CHECKING:
    from harness.faults.interpose import Interposer

P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
# collective -> (output argument, input arguments); an output that is also an input is in place
COLLECTIVE_ARGS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "all_gather": ("tensor_list", ("tensor",)),
    "all_gather_into_tensor": ("output_tensor", ("input_tensor",)),
    "all_gather_single": ("output_tensor", ("input_tensor",)),
    "all_to_all": ("output_tensor_list", ("input_tensor_list",)),
    "all_to_all_single": ("output", ("input",)),
    "reduce_scatter": ("output", ("input_list",)),
    "reduce_scatter_tensor": ("output", ("input",)),
    "reduce_scatter_single": ("output", ("input",)),
    "broadcast": ("tensor", ("tensor",)),
    "all_reduce": ("tensor", ("tensor",)),
    "barrier": (None, ()),
    # rooted: only the root's list is given (gloo's differentiable all-to-all scatters)
    "scatter": ("tensor", ("scatter_list",)),
    "gather": ("gather_list", ("tensor",)),
    "reduce": ("tensor", ("tensor",)),
}
# what a rank of these sends is its inputs alone: none on a scatter's other ranks
ROOTED = frozenset({"scatter", "gather", "reduce"})
# names vary across versions
COLLECTIVE_ARGS = {k: v for k, v in COLLECTIVE_ARGS.items() if hasattr(c10d, k)}
WRAPPED = P2P + tuple(COLLECTIVE_ARGS)


def originals() -> dict[str, Callable]:
    """The torch.distributed functions that `wrappers` replaces (and c10d's `_check_op`)."""
    orig = {name: getattr(c10d, name) for name in WRAPPED}
    orig["_check_op"] = c10d._check_op
    return orig


def global_peer(group: Any, peer: int | None, group_peer: int | None) -> int | None:
    """The peer's global rank, from the call's `dst`/`src` (global) or `group_dst`/`group_src`."""
    if peer is not None:
        return int(peer)
    if group_peer is None:
        return None
    return int(group_peer) if group is None else c10d.get_global_rank(group, group_peer)


def wrappers(ip: Interposer) -> dict[str, Callable]:
    """Replacements for the torch.distributed functions, bound to the interposer `ip`."""
    orig = ip.orig

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = global_peer(group, dst, group_dst)
        tag = ip.p2p_tag(tag)
        return ip.post_send(
            "isend",
            tensor,
            peer,
            lambda t: orig["isend"](t, dst=dst, group=group, tag=tag, group_dst=group_dst),
            (id(group), peer, tag),
        )

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        tag = ip.p2p_tag(tag)
        return ip.post_recv(
            "irecv",
            tensor,
            global_peer(group, src, group_src),
            lambda t: orig["irecv"](t, src=src, group=group, tag=tag, group_src=group_src),
        )

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = global_peer(group, dst, group_dst)
        tag = ip.p2p_tag(tag)
        fw = ip.post_send(
            "send",
            tensor,
            peer,
            lambda t: orig["isend"](t, dst=dst, group=group, tag=tag, group_dst=group_dst),
            (id(group), peer, tag),
        )
        ip.complete(fw)

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        tag = ip.p2p_tag(tag)
        fw = ip.post_recv(
            "recv",
            tensor,
            global_peer(group, src, group_src),
            lambda t: orig["irecv"](t, src=src, group=group, tag=tag, group_src=group_src),
        )
        if fw.real is None:
            return -1
        ip.complete(fw)
        if src is not None:
            return src
        g = group_src if group_src is not None else fw.real._source_rank()
        return g if group is None else c10d.get_global_rank(group, g)

    sends = {orig["isend"], isend}

    def batch_isend_irecv(p2p_op_list):
        c10d._check_p2p_op_list(p2p_op_list)
        works = [
            (isend if p.op in sends else irecv)(p.tensor, p.peer, p.group, p.tag)
            for p in p2p_op_list
        ]
        return [BatchWork(works)] if ip.stage else works  # staged: one Work per batch, as NCCL's

    def check_op(op):
        if op not in (orig["isend"], orig["irecv"], isend, irecv):
            orig["_check_op"](op)

    out: dict[str, Callable] = {
        "isend": isend,
        "irecv": irecv,
        "send": send,
        "recv": recv,
        "batch_isend_irecv": batch_isend_irecv,
        "_check_op": check_op,
    }
    for name in COLLECTIVE_ARGS:
        out[name] = _collective_wrapper(ip, name)
    for name, fn in out.items():
        fn.__name__ = name
    return out


@functools.lru_cache(maxsize=64)
def _signature(fn: Callable) -> inspect.Signature:
    """A collective's signature, read once per function: every case builds its wrappers."""
    return inspect.signature(fn)


def _collective_wrapper(ip: Interposer, name: str) -> Callable:
    """A collective's replacement: bind the call's arguments by name, hand them to `ip`."""
    sig = _signature(ip.orig[name])

    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return ip.collective(name, dict(bound.arguments))

    wrapper.__doc__ = ip.orig[name].__doc__
    return wrapper
