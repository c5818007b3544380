"""The Work objects the interposer hands to an implementation, and the tensor helpers they need.

A `FaultWork` stands for one communication op: its wait() goes back to the interposer, which
completes the real op under the case's short timeout, applies completion faults and turns a
transport error or a timeout into a `CommError` naming the op, the peer and the phase.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from harness.faults.oplog import Op

if TYPE_CHECKING:
    from harness.faults.interpose import Interposer


class FaultWork:
    """The Work the implementation gets: wait() completes the real op, then applies completion
    faults."""

    def __init__(
        self, ip: Interposer, op: Op, *, outputs: Sequence[torch.Tensor] = (), hold: float = 0.0
    ) -> None:
        self._ip = ip
        self.op = op
        self.real: Any = None
        self.done = False
        self.dropped = False  # a dropped collective: never posted here, its wait fails at the limit
        self.after: list[Callable[[], None]] = []
        self.hold = hold
        self.keep: Any = None  # keeps a private payload/receive buffer alive while the op runs
        self.outputs = list(outputs)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Complete the op (within the case's timeout and `timeout`); raises CommError on
        failure."""
        return self._ip.complete(self, timeout)

    def is_completed(self) -> bool:
        if self.dropped:  # never completes: polling it fails at the limit, as a wait does
            self._ip.complete(self, None)
        if not self.done and self.real is None:
            # polling a held send: hand it to the transport, as a blocking wait would
            self._ip.flush()
        if not self.done and self.real is not None and self.real.is_completed():
            self._ip.complete(self, None)
        return self.done

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None if self.real is None else self.real.exception()

    def source_rank(self) -> int:
        return self._source_rank()

    def _source_rank(self) -> int:
        self.wait()
        return self.real._source_rank() if self.real is not None else -1

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return list(self.outputs)

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.result())
        return fut


@dataclass
class Deferred:
    """A send held back until this rank next blocks (send-reuse): the transport reads the buffer
    late. Ops posted after it are held too (`receive` for a receive), so the order stays."""

    work: FaultWork
    tensor: torch.Tensor
    post: Callable[[torch.Tensor], Any]
    corrupt: Callable[[torch.Tensor], None] | None
    receive: bool = False


# -- tensor helpers --------------------------------------------------------------------------------
def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in a collective's argument (a tensor, or a list of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def nbytes(ts: Sequence[torch.Tensor]) -> int:
    """Bytes the tensors hold (logged per op)."""
    return int(sum(t.numel() * t.element_size() for t in ts))


def shares_storage(t: torch.Tensor, others: Sequence[torch.Tensor]) -> bool:
    """Whether `t` lives in the same storage as any of `others` (an output that is also an
    input)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (both on one device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def first_line(e: BaseException) -> str:
    """A transport error's first line, without gloo's source-location prefix."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if line.startswith("[") and "] " in line:  # drop gloo's '[/path/to/file.cc:78] ' prefix
        line = line.split("] ", 1)[1]
    return line
