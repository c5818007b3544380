"""Messages between the parent and its ranks: plain pickle over an authenticated Unix socket.

Plain pickle (not multiprocessing's ForkingPickler) so tensors travel as bytes rather than as
shared-memory file descriptors, which would need multiprocessing's own resource sharer.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any


def send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())
