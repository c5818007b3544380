"""Messages between the parent and its ranks: plain pickle over an authenticated Unix socket.

Plain pickle (not multiprocessing's ForkingPickler) so tensors travel as bytes rather than as
shared-memory file descriptors, which would need multiprocessing's own resource sharer. A CPU
tensor travels as (raw bytes, dtype, shape): bit-exact, and ~20x cheaper to load than torch's own
pickling (measured: 7 small tensors 2.5 ms -> 0.1 ms), which ran for every shard of every case.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from multiprocessing.connection import Connection
from typing import Any

import torch


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor from its raw bytes (an independent, writable copy)."""
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(shape)


def _reduce_tensor(t: torch.Tensor):
    """Plain strided CPU tensors as raw bytes; anything else (CUDA, sparse, quantized) as torch
    pickles it."""
    if t.layout != torch.strided or t.is_quantized or t.device.type != "cpu" or t.requires_grad:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    c = t.contiguous()
    data = c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return _tensor, (data, str(c.dtype).removeprefix("torch."), tuple(c.shape))


_DISPATCH = copyreg.dispatch_table.copy()
_DISPATCH[torch.Tensor] = _reduce_tensor


def dumps(obj: Any) -> bytes:
    """Pickle a message, CPU tensors as raw bytes."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _DISPATCH
    p.dump(obj)
    return buf.getvalue()


def send(conn: Connection, obj: Any) -> None:
    """Send one message (a protocol.Message dict) over the rank's connection."""
    conn.send_bytes(dumps(obj))


def recv(conn: Connection) -> Any:
    """Receive one message; EOFError / OSError when the other side is gone."""
    return pickle.loads(conn.recv_bytes())
