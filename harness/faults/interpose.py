"""Interposition inside one rank: wrap the torch.distributed calls ring implementations use, log
every op (kind, peer, bytes, order, phase) and apply the faults scheduled on this rank.

`active(ip)` patches the functions on both `torch.distributed` and
`torch.distributed.distributed_c10d` for one case and restores them afterwards. Every Work handed to
the implementation is a `FaultWork` whose wait() completes the real op under the case's short
timeout and turns a transport error or a timeout into a `CommError` naming the op, the peer and the
phase.

The pieces: `Interposer` and `active` here (posting, holding and completing ops); c10d's
collectives and what each fault means for one in `collectives`; torch's functional collectives in
`functional`; the refusal of process groups made inside `run` in `pg_guard`; which faults select an
op and what fired in `schedule`; the Work objects in `work`; the op log and its readers in `oplog`;
the replacement functions in `wrappers`; what each fault does to a tensor or the process in
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
from harness.faults import collectives, functional, inject, pg_guard, staging
from harness.faults.oplog import (
    Op,
    compact_log,
    forget,
    note_when_blocked,
    overwrite,
    pending_text,
    phase_counts,
    unblocked,
)
from harness.faults.schedule import FaultSchedule
from harness.faults.schema import FaultSpec
from harness.faults.work import Deferred, FaultWork, first_line, nbytes, overlaps
from harness.faults.wrappers import COLLECTIVE_ARGS, P2P, WRAPPED, originals
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
        ring: Sequence[int] = (),
    ) -> None:
        self.rank = rank  # group rank
        self.ring = tuple(ring)  # the ring's global ranks (groups made inside run: pg_guard)
        self.case_id = case_id
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
        # (op index, n) -> (op, the caller's buffer, its content at the post): send-reuse's watch
        self.watch: dict[tuple[int, int], tuple[Op, torch.Tensor, torch.Tensor]] = {}
        self.last_exit = self.start
        self.nested = False  # inside an original collective that calls another wrapped one
        self.in_hook = False  # inside a functional op's real call (profile's dispatch log skips it)
        self.inflight: dict[int, tuple[torch.Tensor, FaultWork]] = {}  # functional outputs
        self.peers_of: dict[Any, tuple[int, ...] | None] = {}  # group -> global ranks
        self.pending_path = pending_path
        self.down: set[tuple] = set()  # (group, peer, tag) channels a drop took down
        self.orig = originals()
        # ("post" | "wait" | "done", op index, phase, seconds) in program order, when `profile`
        # listens (harness.ranks.instrument); None otherwise
        self.events: list[tuple] | None = None
        unblocked()  # the last case's waits leave no note in this one's file
        if pending_path and os.path.exists(pending_path):
            # blanked in place: cheaper than unlink + create per case
            overwrite(pending_path, "", reopen=True)
        elif pending_path:
            forget(pending_path)  # a descriptor kept for a file since removed

    # -- phases, timing ------------------------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        """Enter forward / backward / done (the worker knows which); 'done' flushes held sends."""
        self._stretch()
        if phase == "done":
            unblocked()
            self.flush()
            self.check_watch(final=True)
        self.phase = phase
        self.last_exit = time.monotonic()

    def _stretch(self) -> None:
        """Straggler (compute): the time this rank spent outside communication calls, times k."""
        self.schedule.stretch(self.phase, time.monotonic() - self.last_exit)
        self.last_exit = time.monotonic()

    # -- scheduling ----------------------------------------------------------------------------
    def open_op(
        self,
        kind: str,
        direction: str,
        peer: int | None,
        tensors: Sequence[torch.Tensor],
        peers: tuple[int, ...] | None = None,
        inputs: bool = True,
    ) -> tuple[Op, dict[str, list[FaultSpec]], float]:
        """Log the op and find the faults scheduled on it; crash and post-delays happen here.

        `peers`: a collective's group (global ranks); `inputs`: it reads buffers apart from its
        output (FaultSpec.applies_to).
        """
        self._stretch()
        self.check_watch()
        op = Op(len(self.ops), kind, direction, peer, nbytes(tensors), self.phase, peers=peers)
        self.ops.append(op)
        if self.events is not None:
            self.events.append(("post", op.index, self.phase, time.perf_counter()))
        hits, hold = self.schedule.select(op, direction, inputs)
        return op, hits, hold

    def close_op(self, t_open: float) -> None:
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
        op, hits, hold = self.open_op(kind, "send", peer, [tensor])
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
            self.close_op(t_open)
            return fw
        corrupt = self.schedule.corrupter(hits["corrupt"], op) if "corrupt" in hits else None
        self.pending[op.index] = op
        # later sends queue behind a held one: order is kept
        if "send-reuse" in hits or self.deferred:
            if "send-reuse" in hits:
                self.schedule.fire(hits["send-reuse"])
                self.watch_buffers(op, [(tensor, tensor.clone())])
                fw.after.append(lambda: self.unwatch(op.index))
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
        self.close_op(t_open)
        return fw

    def post_recv(
        self, kind: str, tensor: torch.Tensor, peer: int | None, post: Callable[[torch.Tensor], Any]
    ) -> FaultWork:
        """A receive: maybe into a private buffer (early-read: the user's buffer holds NaN until
        wait)."""
        t_open = time.monotonic()
        op, hits, hold = self.open_op(kind, "recv", peer, [tensor])
        self.check_overlap([tensor], op)
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
            self.close_op(t_open)
            return fw
        fw.real, fw.keep = post(target), target
        if fw.real is None:
            fw.done = True
            self.pending.pop(op.index, None)
        self.close_op(t_open)
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

    def _violation(self, op: Op, how: str) -> None:
        what, until = ("send buffer", "send") if op.direction == "send" else ("input buffer", "op")
        self.violations.append(
            f"rank {self.rank}: {op.label()}: {what} modified before the {until} completed{how}"
        )

    def watch_buffers(self, op: Op, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """send-reuse: watch each (caller's buffer, its content now) until `op` completes."""
        for n, (t, snap) in enumerate(pairs):
            self.watch[(op.index, n)] = (op, t, snap)

    def check_watch(self, final: bool = False) -> None:
        """send-reuse: a watched buffer that changed before its op completed is a violation."""
        for key, (op, t, snap) in list(self.watch.items()):
            if key not in self.watch:
                continue  # its op's other buffer was reported just now
            if not inject.same_bits(t, snap):
                self._violation(op, " (the transport may read it late)")
                self._drop_watch(op.index)
            elif final:
                del self.watch[key]  # never waited, but never modified either

    def check_overlap(self, outs: Sequence[torch.Tensor], op: Op) -> None:
        """send-reuse: an op that will write into a buffer still being sent is a violation, whether
        or not its data has landed by the next content check (that would be a race)."""
        for key, (sop, t, _snap) in list(self.watch.items()):
            if key in self.watch and any(overlaps(o, t) for o in outs):
                self._violation(sop, f": {op.label()} writes into it")
                self._drop_watch(sop.index)

    def unwatch(self, idx: int) -> None:
        """Op `idx` completed: a change of its watched buffers until now is a violation."""
        entries = [e for k, e in self.watch.items() if k[0] == idx]
        self._drop_watch(idx)
        if any(not inject.same_bits(t, snap) for _op, t, snap in entries):
            self._violation(entries[0][0], " (the transport may read it late)")

    def _drop_watch(self, idx: int) -> None:
        for key in [k for k in self.watch if k[0] == idx]:
            del self.watch[key]

    # -- collectives -------------------------------------------------------------------------------
    def collective(self, kind: str, args: dict) -> FaultWork | None:
        """Any c10d collective (harness.faults.collectives)."""
        return collectives.run(self, kind, args)

    # -- completion --------------------------------------------------------------------------------
    def complete(self, fw: FaultWork, timeout: datetime.timedelta | None = None) -> bool:
        """wait(): finish the real op within the case's timeout, then deliver/corrupt/hold as
        scheduled."""
        if fw.done:
            return True
        if self.events is not None:
            self.events.append(("wait", fw.op.index, self.phase, time.perf_counter()))
        self._stretch()
        self.check_watch()
        self.flush()
        op = fw.op
        if fw.dropped:
            self._never(fw, timeout)
        if fw.real is None:  # nothing was posted (not a member of the group)
            fw.done = True
            return True
        op.state = "waiting"
        if self.pending_path:  # a rank that stays blocked leaves its note (oplog.note_when_blocked)
            note_when_blocked(functools.partial(self._write_pending, op))
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
        self.close_op(t0)
        return True

    def _never(self, fw: FaultWork, timeout: datetime.timedelta | None) -> None:
        """A collective dropped on this rank never completes: it fails at the limit, naming the op,
        the group's ranks and the phase, as its peers' waits do."""
        op = fw.op
        op.state = "waiting"
        self._write_pending(op)
        limit = min(self.timeout_s, self.end - time.monotonic())
        if timeout is not None and timeout.total_seconds() > 0:
            limit = min(limit, timeout.total_seconds())
        inject.sleep(limit)
        op.state = "failed"
        raise CommError(
            f"rank {self.rank}: {op.label()} timed out after {max(limit, 0.0):.1f} s "
            "(a fault dropped it on this rank)"
        )

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
    case, hook the functional collectives and guard process-group creation."""
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
        with functional.hooked(ip), pg_guard.guarded(ip.ring, ip.case_id):
            yield ip
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        ip.deferred.clear()
        ip.inflight.clear()
