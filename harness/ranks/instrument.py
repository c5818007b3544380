"""Rank side of `ring-harness profile`: what one call computes between its communication ops, and
its peak memory.

Two of torch's own instruments do the measuring. A `TorchDispatchMode` sees every aten op the ring
runs, and `torch.utils.flop_counter.flop_registry` gives each matmul-like op its FLOPs. The fault
interposer logs when each op is posted and waited (`Interposer.events`). Both append to one list, in
program order: a rank is one thread. `torch.distributed._tools.mem_tracker.MemTracker` tracks the
bytes of live tensors the call creates, so the peak does not depend on the allocator (RSS would).
On CUDA, `torch.cuda.max_memory_allocated` says the same for the device, and CUDA events on the
current stream time each wait and the whole call (`CudaMarks`). The parent reads the events, the
peaks and the times (harness.profiling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

FUNCTIONAL = "_c10d_functional"  # torch's traceable collectives: dispatcher ops, not dist.* calls


def _formulas() -> dict:
    """torch's FLOP formulas, plus the CPU flash SDPA ops it lacks (torch 2.13). Their first
    arguments are those of the CUDA flash ops, (q, k, v) and (dout, q, k, v), so the same
    formulas count them. Without them a CPU ring on SDPA would seem to compute nothing."""
    aten = torch.ops.aten
    table = dict(flop_registry)
    cpu = {
        "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
        "_scaled_dot_product_flash_attention_for_cpu_backward": (
            aten._scaled_dot_product_flash_attention_backward
        ),
    }
    for name, like in cpu.items():
        op = getattr(aten, name, None)
        if op is not None and like in table:
            table[op] = table[like]
    return table


FORMULAS = _formulas()


class ComputeLog(TorchDispatchMode):
    """Appends ("compute", flops, phase, seconds) for each op with a FLOP formula; consecutive ones
    merge, keeping the time the last one ended. A functional collective (DTensor, torch's context
    parallel) is logged by the interposer's hook (harness.faults.functional); one dispatched from
    C++, which the hook does not see, is logged here, its `wait_tensor` as its wait."""

    def __init__(self, events: list, ip: Any) -> None:
        super().__init__()
        self.events = events
        self.ip = ip
        self.phase = lambda: ip.phase
        self.inflight: dict[int, int] = {}  # id of a collective's output -> its op index

    def _functional(self, func, args, kwargs):
        name = func._opname
        if name == "wait_tensor":
            idx = self.inflight.pop(id(args[0]), None)
            if idx is not None:
                self.events.append(("wait", idx, self.phase(), time.perf_counter()))
            out = func(*args, **kwargs)
            if idx is not None:
                self.events.append(("done", idx, self.phase(), time.perf_counter()))
            return out
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [
            t
            for a in args
            if isinstance(a, (list, tuple))
            for t in a
            if isinstance(t, torch.Tensor)
        ]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        idx = self.ip.note_functional(name, nbytes)
        self.events.append(("post", idx, self.phase(), time.perf_counter()))
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            self.inflight[id(t)] = idx
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == FUNCTIONAL:
            if self.ip.in_hook:  # the interposer's functional hook logs it (faults.functional)
                return func(*args, **kwargs)
            return self._functional(func, args, kwargs)
        out = func(*args, **kwargs)
        count = FORMULAS.get(func.overloadpacket)
        if count is not None:
            flops = int(count(*args, **kwargs, out_val=out))
            last = self.events[-1] if self.events else None
            phase = self.phase()
            now = time.perf_counter()
            if last is not None and last[0] == "compute" and last[2] == phase:
                self.events[-1] = ("compute", last[1] + flops, phase, now)
            elif flops:
                self.events.append(("compute", flops, phase, now))
        return out


class CudaMarks(list):
    """The event list of a CUDA rank. Each "wait" and "done" appended also records a CUDA event on
    the current stream: just before and just after the wait. The time between them is what the GPU
    spent on that wait: exposed communication."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[str, int, str, Any]] = []  # (kind, op index, phase, CUDA event)

    def append(self, event: Any) -> None:
        super().append(event)
        if event[0] in ("wait", "done"):
            self.marks.append((event[0], event[1], event[2], _cuda_event()))

    def elapsed(self) -> list[list]:
        """[op index, phase, ms] per wait that completed, in program order (after a synchronize)."""
        began: dict[int, tuple[str, Any]] = {}
        out = []
        for kind, op, phase, ev in self.marks:
            if kind == "wait":
                began[op] = (phase, ev)
            elif op in began:
                ph, start = began.pop(op)
                out.append([op, ph, float(start.elapsed_time(ev))])
        return out


def _cuda_event() -> Any:
    """A timing CUDA event, recorded now on the current stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _peak(tracker: Any) -> int:
    """The tracker's peak of live tensor bytes, over every device it saw."""
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(sum(per.get("Total", 0) for per in snapshot.values()))


@contextlib.contextmanager
def profiled(ip: Any, device: torch.device) -> Iterator[dict]:
    """Profile what runs inside: the dict it yields gets `events` and `peak_bytes` at the end; on
    CUDA also `cuda_peak_bytes`, `cuda_call_ms` and `cuda_waits` ([op index, phase, ms])."""
    from torch.distributed._tools.mem_tracker import MemTracker

    report: dict = {}
    cuda = device.type == "cuda"
    events: list = CudaMarks() if cuda else []
    ip.events = events
    tracker = MemTracker()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        begin = _cuda_event()
    start = time.perf_counter()
    try:
        with tracker, ComputeLog(events, ip):
            yield report
    finally:
        ip.events = None
    report["events"] = [list(e) for e in events]
    report["start"] = start
    report["peak_bytes"] = _peak(tracker)
    if cuda:
        end = _cuda_event()
        report["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
        torch.cuda.synchronize(device)
        report["cuda_call_ms"] = float(begin.elapsed_time(end))
        report["cuda_waits"] = events.elapsed()
