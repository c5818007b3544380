"""Interposition inside one rank: wrap the torch.distributed calls ring implementations use, log
every op (kind, peer, bytes, order, phase) and apply the faults scheduled on this rank.

`active(ip)` patches the functions on both `torch.distributed` and
`torch.distributed.distributed_c10d` for one case and restores them afterwards. Every Work handed to
the implementation is a `FaultWork` whose wait() completes the real op under the case's short
timeout and turns a transport error or a timeout into a `CommError` naming the op, the peer and the
phase.

The pieces: `Interposer` and `active` here (posting, holding and completing ops); which faults
select an op and what fired in `schedule`; the Work objects in `work`; the op log and its readers in
`oplog`; the replacement functions in `wrappers`; what each fault does to a tensor or the process in
`inject`. Runs inside a rank process.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.errors import CommError
from harness.faults import inject, staging
from harness.faults.oplog import Op, compact_log, overwrite, pending_text, phase_counts
from harness.faults.schedule import FaultSchedule
from harness.faults.schema import FaultSpec
from harness.faults.work import (
    Deferred,
    FaultWork,
    first_line,
    nbytes,
    overlaps,
    shares_storage,
    tensors_of,
)
from harness.faults.wrappers import COLLECTIVE_ARGS, P2P, ROOTED, WRAPPED, originals
from harness.faults.wrappers import wrappers as make_wrappers

# what other code imports from here (the mechanism's entry points), wherever it is defined now
__all__ = [
    "COLLECTIVE_ARGS",
    "P2P",
    "WRAPPED",
    "CommError",
    "FaultWork",
    "Interposer",
    "Op",
    "active",
    "phase_counts",
]


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


class Interposer:
    """Per-rank, per-case state: the op log, the ops in flight and the faults' schedule."""

    def __init__(
        self,
        rank: int,
        faults: Sequence[FaultSpec] = (),
        *,
        seed: int = 0,
        timeout_s: float = 30.0,
        budget_s: float | None = None,
        pending_path: str | None = None,
        note_path: str | None = None,
        exit_fn: Callable[[int], None] | None = None,
        case_id: Any = None,
        stage: bool = False,
    ) -> None:
        self.rank = rank  # group rank
        self.stage = stage  # P2P through host buffers, NCCL's matching (harness.faults.staging)
        self.schedule = FaultSchedule(
            rank, faults, seed=seed, note_path=note_path, exit_fn=exit_fn, case_id=case_id
        )
        self.timeout_s = timeout_s
        self.start = time.monotonic()
        self.end = self.start + (budget_s if budget_s is not None else timeout_s)
        self.phase = "setup"
        self.ops: list[Op] = []
        self.pending: dict[int, Op] = {}
        self.violations: list[str] = []
        self.deferred: list[Deferred] = []
        self.watch: dict[int, tuple[Op, torch.Tensor, torch.Tensor]] = {}
        self.last_exit = self.start
        self._nested = False  # inside an original collective that calls another wrapped one
        self.pending_path = pending_path
        self.down: set[tuple] = set()  # (group, peer, tag) channels a drop took down
        self.orig = originals()
        # ("post" | "wait" | "done", op index, phase, seconds) in program order, when `profile`
        # listens (harness.ranks.instrument); None otherwise
        self.events: list[tuple] | None = None
        if pending_path and os.path.exists(pending_path):
            overwrite(pending_path, "")  # blanked in place: cheaper than unlink + create per case

    # -- phases, timing ------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """Enter forward / backward / done (the worker knows which); 'done' flushes held sends."""
        self._stretch()
        if phase == "done":
            self.flush()
            self._check_watch(final=True)
        self.phase = phase
        self.last_exit = time.monotonic()

    def _stretch(self) -> None:
        """Straggler (compute): the time this rank spent outside communication calls, times k."""
        self.schedule.stretch(self.phase, time.monotonic() - self.last_exit)
        self.last_exit = time.monotonic()

    # -- scheduling ----------------------------------------------------------------------------
    def _open(
        self, kind: str, direction: str, peer: int | None, tensors: Sequence[torch.Tensor]
    ) -> tuple[Op, dict[str, list[FaultSpec]], float]:
        """Log the op and find the faults scheduled on it; crash and post-delays happen here."""
        self._stretch()
        self._check_watch()
        op = Op(len(self.ops), kind, direction, peer, nbytes(tensors), self.phase)
        self.ops.append(op)
        if self.events is not None:
            self.events.append(("post", op.index, self.phase, time.perf_counter()))
        hits, hold = self.schedule.select(op, direction)
        return op, hits, hold

    def _close(self, t_open: float) -> None:
        self.schedule.slow_comm(self.phase, time.monotonic() - t_open)
        self.last_exit = time.monotonic()

    # -- point to point --------------------------------------------------------------------------
    def post_send(
        self,
        kind: str,
        tensor: torch.Tensor,
        peer: int | None,
        post: Callable[[torch.Tensor], Any],
        channel: tuple = (),
    ) -> FaultWork:
        """A send: maybe dropped, corrupted, or held back with its buffer watched (send-reuse). A
        drop takes its channel (group, peer, tag) down: this and every later message on it is never
        delivered, so the receiver waits until its timeout (no message is matched out of order)."""
        t_open = time.monotonic()
        op, hits, hold = self._open(kind, "send", peer, [tensor])
        fw = FaultWork(self, op, outputs=[tensor], hold=hold)
        if self.stage:
            post = functools.partial(staging.post_send, post)
        if "drop" in hits or (channel and channel in self.down):
            if "drop" in hits:
                self.schedule.fire(hits["drop"])
                self.down.add(channel)
                self.schedule.note()
            op.state = "dropped"
            fw.done = True
            self._close(t_open)
            return fw
        corrupt = self.schedule.corrupter(hits["corrupt"], op) if "corrupt" in hits else None
        self.pending[op.index] = op
        # later sends queue behind a held one: order is kept
        if "send-reuse" in hits or self.deferred:
            if "send-reuse" in hits:
                self.schedule.fire(hits["send-reuse"])
                self.watch[op.index] = (op, tensor, tensor.clone())
                fw.after.append(lambda: self._unwatch(op.index))
            op.state = "deferred"
            self.deferred.append(Deferred(fw, tensor, post, corrupt))
        else:
            payload = tensor
            if corrupt is not None:
                payload = tensor.clone()
                corrupt(payload)
            fw.real, fw.keep = post(payload), payload
            if fw.real is None:  # not a member of the group: nothing to wait for
                fw.done = True
                self.pending.pop(op.index, None)
        self._close(t_open)
        return fw

    def post_recv(
        self, kind: str, tensor: torch.Tensor, peer: int | None, post: Callable[[torch.Tensor], Any]
    ) -> FaultWork:
        """A receive: maybe into a private buffer (early-read: the user's buffer holds NaN until
        wait)."""
        t_open = time.monotonic()
        op, hits, hold = self._open(kind, "recv", peer, [tensor])
        self._check_overlap([tensor], op)
        fw = FaultWork(self, op, outputs=[tensor], hold=hold)
        target = tensor
        if "early-read" in hits:
            target = torch.empty_like(tensor)
            fw.after.append(lambda: tensor.copy_(target))
            inject.poison(tensor)
            self.schedule.fire(hits["early-read"])
        if "corrupt" in hits:
            corrupt = self.schedule.corrupter(hits["corrupt"], op)
            fw.after.append(lambda: corrupt(tensor))
        self.pending[op.index] = op
        if self.stage:
            post = functools.partial(staging.post_recv, post)
        if self.deferred:
            # behind a held send: NCCL runs a peer's ops in the order posted, so a receive posted
            # before the send it follows would wait on the peer's held send (a deadlock at W = 2)
            op.state = "deferred"
            self.deferred.append(Deferred(fw, target, post, None, receive=True))
            self._close(t_open)
            return fw
        fw.real, fw.keep = post(target), target
        if fw.real is None:
            fw.done = True
            self.pending.pop(op.index, None)
        self._close(t_open)
        return fw

    def flush(self) -> None:
        """Hand every held op to the transport in the order posted, a send with its buffer as it is
        now (this rank is about to block)."""
        items, self.deferred = self.deferred, []
        for d in items:
            payload = d.tensor if d.receive else d.tensor.clone()
            if d.corrupt is not None:
                d.corrupt(payload)
            d.work.op.state = "posted"
            d.work.real, d.work.keep = d.post(payload), payload
            if d.work.real is None:
                d.work.done = True
                self.pending.pop(d.work.op.index, None)

    def _violation(self, op: Op, when: str) -> None:
        self.violations.append(f"rank {self.rank}: {op.label()}: send buffer modified {when}")

    def _check_watch(self, final: bool = False) -> None:
        """send-reuse: a watched send buffer that changed before its send completed is a
        violation."""
        for idx, (op, t, snap) in list(self.watch.items()):
            if not inject.same_bits(t, snap):
                self._violation(op, "before the send completed (the transport may read it late)")
                del self.watch[idx]
            elif final:
                del self.watch[idx]  # never waited, but never modified either

    def _check_overlap(self, outs: Sequence[torch.Tensor], op: Op) -> None:
        """send-reuse: an op that will write into a buffer still being sent is a violation, whether
        or not its data has landed by the next content check (that would be a race)."""
        for idx, (sop, t, _snap) in list(self.watch.items()):
            if any(overlaps(o, t) for o in outs):
                self._violation(sop, f"before the send completed: {op.label()} writes into it")
                del self.watch[idx]

    def _unwatch(self, idx: int) -> None:
        entry = self.watch.pop(idx, None)
        if entry is not None and not inject.same_bits(entry[1], entry[2]):
            self._violation(entry[0], "before the send completed (the transport may read it late)")

    # -- collectives -------------------------------------------------------------------------------
    def collective(self, kind: str, args: dict) -> FaultWork | None:
        """Any collective: run it async, give early-read a private output, wait here if it was
        blocking."""
        # e.g. all_gather_into_tensor calling all_gather_single: log the outer call only
        if self._nested:
            return self.orig[kind](**args)
        out_name, in_names = COLLECTIVE_ARGS[kind]
        outs = tensors_of(args.get(out_name)) if out_name else []
        ins = [t for n in in_names for t in tensors_of(args.get(n))]
        blocking = not args.get("async_op", False)
        self.flush()  # a collective may block: held sends must be on the wire first
        t_open = time.monotonic()
        op, hits, hold = self._open(
            kind, "collective", None, ins if kind in ROOTED else ins or outs
        )
        self._check_overlap(outs, op)
        fw = FaultWork(self, op, outputs=outs, hold=hold)
        call = dict(args, async_op=True)
        poisoned: list[torch.Tensor] = []
        if "early-read" in hits and not blocking and outs:
            inplace = out_name in in_names
            privates = [_private(o, ins, inplace) for o in outs]
            pairs = [(o, p) for o, p in zip(outs, privates, strict=True) if p is not o]
            if pairs:
                call[out_name] = (
                    privates[0] if isinstance(args[out_name], torch.Tensor) else list(privates)
                )
                fw.after.append(lambda: [o.copy_(p) for o, p in pairs])
                fw.keep = privates
                poisoned = [o for o, _ in pairs]
                self.schedule.fire(hits["early-read"])
        if "corrupt" in hits and outs:
            corrupt = self.schedule.corrupter(hits["corrupt"], op)
            fw.after.append(lambda: corrupt(outs[0]))
        self.pending[op.index] = op
        self._nested = True
        try:
            fw.real = self.orig[kind](**call)
        finally:
            self._nested = False
        for o in poisoned:
            inject.poison(o)
        if fw.real is None:
            fw.done = True
            self.pending.pop(op.index, None)
        self._close(t_open)
        if blocking:
            self.complete(fw)
            return None
        return fw

    # -- completion --------------------------------------------------------------------------------
    def complete(self, fw: FaultWork, timeout: datetime.timedelta | None = None) -> bool:
        """wait(): finish the real op within the case's timeout, then deliver/corrupt/hold as
        scheduled."""
        if fw.done:
            return True
        if self.events is not None:
            self.events.append(("wait", fw.op.index, self.phase, time.perf_counter()))
        self._stretch()
        self._check_watch()
        self.flush()
        op = fw.op
        if fw.real is None:  # nothing was posted (not a member of the group)
            fw.done = True
            return True
        op.state = "waiting"
        self._write_pending(op)
        t0 = time.monotonic()
        limit = min(self.timeout_s, self.end - t0)
        if timeout is not None and timeout.total_seconds() > 0:
            limit = min(limit, timeout.total_seconds())
        if limit <= 0:
            op.state = "failed"
            raise CommError(
                f"rank {self.rank}: {op.label()} not completed: the case's "
                "communication time "
                f"({self.end - self.start:.1f} s) is spent"
            )
        try:
            ok = fw.real.wait(datetime.timedelta(seconds=limit))
        except RuntimeError as e:
            op.state = "failed"
            raise CommError(
                f"rank {self.rank}: {op.label()} failed after "
                f"{time.monotonic() - t0:.1f} s: "
                f"{first_line(e)}"
            ) from None
        if ok is False:
            op.state = "failed"
            raise CommError(
                f"rank {self.rank}: {op.label()} timed out after {time.monotonic() - t0:.1f} s"
            )
        fw.done = True
        op.state = "done"
        if self.events is not None:
            self.events.append(("done", op.index, self.phase, time.perf_counter()))
        self.pending.pop(op.index, None)
        for fn in fw.after:
            fn()
        inject.sleep(fw.hold)
        self._close(t0)
        return True

    def _write_pending(self, waiting: Op) -> None:
        """Leave this rank's pending ops on disk before blocking, for the parent's hang report."""
        if not self.pending_path:
            return
        try:
            overwrite(self.pending_path, pending_text(self.rank, waiting, self.pending.values()))
        except OSError:
            pass

    # -- results -----------------------------------------------------------------------------------
    def note_functional(self, kind: str, nbytes: int) -> int:
        """Log a functional collective (torch's `_c10d_functional` ops, which skip the Python calls
        this interposer wraps); `profile` sees them in its dispatch mode. Returns its op index."""
        op = Op(len(self.ops), kind, "collective", None, nbytes, self.phase, state="done")
        self.ops.append(op)
        return op.index

    def report(self) -> dict:
        """Which faults fired (fault id -> times), send-buffer violations, ops still pending."""
        return {
            "fired": dict(self.schedule.fired),
            "violations": list(self.violations),
            "pending": [o.label() for o in self.pending.values()],
        }

    def compact_log(self) -> list[list]:
        """The op log as small lists: [kind, peer, bytes, phase, state], in order."""
        return compact_log(self.ops)

    def p2p_tag(self, tag: int) -> int:
        """The tag a P2P op is posted with: its own, or staging's one tag (NCCL matches in FIFO
        order)."""
        return staging.STAGED_TAG if self.stage else tag

    def wrappers(self) -> dict[str, Callable]:
        """Replacements for the torch.distributed functions, bound to this interposer."""
        return make_wrappers(self)


@contextlib.contextmanager
def active(ip: Interposer) -> Iterator[Interposer]:
    """Patch torch.distributed (and distributed_c10d) with `ip`'s wrappers for the duration of a
    case."""
    fns = ip.wrappers()
    saved = [
        (mod, name, getattr(mod, name))
        for mod in (dist, c10d)
        for name in fns
        if hasattr(mod, name)
    ]
    try:
        for mod, name, _ in saved:
            setattr(mod, name, fns[name])
        yield ip
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        ip.deferred.clear()
