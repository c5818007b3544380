"""c10d collectives under the interposer, and what each fault kind means for one.

Every collective runs async underneath, so a fault can act between its post and its wait:
- early-read: an async op gets private outputs; the caller's read NaN until wait(). A blocking op
  has no such window, so the fault does not fire on it.
- send-reuse: an async op reads copies of its inputs, and the caller's inputs are watched until
  wait(). A change before then is a violation: a transport may read them late.
- drop: this rank never joins. Its wait fails at the case's limit, and so do its peers' waits, each
  naming the op, the group's ranks and the phase.
- corrupt: seeded bits of the first output flip at completion.
- delay: before the post (`where: post`) or after completion (`complete`), by the schedule.
The functional collectives (harness.faults.functional) follow the same rules. Runs inside a rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as c10d

from harness.faults import inject
from harness.faults.schema import FaultSpec
from harness.faults.work import FaultWork, shares_storage, tensors_of
from harness.faults.wrappers import COLLECTIVE_ARGS, ROOTED

if TYPE_CHECKING:
    from harness.faults.interpose import Interposer


def group_ranks(ip: Interposer, group: Any) -> tuple[int, ...] | None:
    """The global ranks of a process group (None: the world), cached per group; None if unknown."""
    key = group if isinstance(group, str) else id(group)
    if key not in ip.peers_of:
        try:
            pg = c10d._resolve_process_group(group) if isinstance(group, str) else group
            ip.peers_of[key] = tuple(c10d.get_process_group_ranks(pg or c10d.group.WORLD))
        except Exception:  # no process group (a unit test's fake transport)
            ip.peers_of[key] = None
    return ip.peers_of[key]


def _private(out: torch.Tensor, ins: list, inplace: bool) -> torch.Tensor:
    """The buffer an early-read op really receives into, so the caller's buffer can be poisoned.

    An in-place op gets a clone. An output that shares storage with an input stays itself.
    Any other output gets a fresh tensor of its shape.
    """
    if inplace:
        return out.clone()
    if shares_storage(out, ins):
        return out
    return torch.empty_like(out)


def drop(ip: Interposer, fw: FaultWork, specs: Sequence[FaultSpec]) -> None:
    """This rank never joins the op: its wait fails at the limit (Interposer.complete)."""
    ip.schedule.fire(specs)
    ip.schedule.note()
    fw.op.state = "dropped"
    fw.dropped = True


def watch_inputs(
    ip: Interposer, fw: FaultWork, specs: Sequence[FaultSpec], call: dict, names: Sequence[str]
) -> None:
    """send-reuse: the op reads copies of `call`'s inputs; the caller's are watched until wait()."""
    pairs = []
    for name in names:
        value = call.get(name)
        if isinstance(value, torch.Tensor):
            call[name] = value.detach().clone()
            pairs.append((value, call[name]))
        elif isinstance(value, (list, tuple)):
            call[name] = [t.detach().clone() for t in value]
            pairs += list(zip(value, call[name], strict=True))
    if not pairs:
        return
    ip.watch_buffers(fw.op, pairs)
    fw.after.append(lambda: ip.unwatch(fw.op.index))
    fw.keep = (fw.keep, [copy for _, copy in pairs])
    ip.schedule.fire(specs)


def _early_read(
    ip: Interposer, fw: FaultWork, hits: dict, call: dict, out_name: str, ins: list, inplace: bool
) -> list[torch.Tensor]:
    """Private outputs for an early-read op; returns the caller's buffers to poison once posted."""
    outs = fw.outputs
    privates = [_private(o, ins, inplace) for o in outs]
    pairs = [(o, p) for o, p in zip(outs, privates, strict=True) if p is not o]
    if not pairs:
        return []
    call[out_name] = privates[0] if isinstance(call[out_name], torch.Tensor) else list(privates)
    fw.after.append(lambda: [o.copy_(p) for o, p in pairs])
    fw.keep = privates
    ip.schedule.fire(hits["early-read"])
    return [o for o, _ in pairs]


def run(ip: Interposer, kind: str, args: dict) -> FaultWork | None:
    """Any c10d collective: run it async, apply its faults, wait here if the call was blocking."""
    # e.g. all_gather_into_tensor calling all_gather_single: log the outer call only
    if ip.nested:
        return ip.orig[kind](**args)
    out_name, in_names = COLLECTIVE_ARGS[kind]
    outs = tensors_of(args.get(out_name)) if out_name else []
    ins = [t for n in in_names for t in tensors_of(args.get(n))]
    inplace = out_name in in_names
    blocking = not args.get("async_op", False)
    ip.flush()  # a collective may block: held sends must be on the wire first
    t_open = time.monotonic()
    peers = group_ranks(ip, args.get("group"))
    logged = ins if kind in ROOTED else ins or outs
    op, hits, hold = ip.open_op(kind, "collective", None, logged, peers, bool(ins) and not inplace)
    ip.check_overlap(outs, op)
    fw = FaultWork(ip, op, outputs=outs, hold=hold)
    ip.pending[op.index] = op
    if "drop" in hits:
        drop(ip, fw, hits["drop"])
    else:
        call = dict(args, async_op=True)
        poisoned: list[torch.Tensor] = []
        if not blocking and "early-read" in hits and outs:
            poisoned = _early_read(ip, fw, hits, call, out_name, ins, inplace)
        if not blocking and "send-reuse" in hits and ins and not inplace:
            watch_inputs(ip, fw, hits["send-reuse"], call, in_names)
        if "corrupt" in hits and outs:
            corrupt = ip.schedule.corrupter(hits["corrupt"], op)
            fw.after.append(lambda: corrupt(outs[0]))
        ip.nested = True
        try:
            fw.real = ip.orig[kind](**call)
        finally:
            ip.nested = False
        for o in poisoned:
            inject.poison(o)
        if fw.real is None:  # not a member of the group: nothing to wait for
            fw.done = True
            ip.pending.pop(op.index, None)
    ip.close_op(t_open)
    if blocking:
        ip.complete(fw)
        return None
    return fw
