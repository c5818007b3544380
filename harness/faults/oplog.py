"""The op log: one `Op` per communication call on a rank, and its two written forms.

Inside a rank the interposer keeps `Op`s; the reply to the parent carries them compact, one
`[kind, peer, bytes, phase, state]` list per call, in order (`ResultMessage["comm"]`). A wait that
blocks for NOTE_AFTER_S also leaves the rank's pending ops in a small file, read by the pool for a
hang report (`pending_text`, `note_when_blocked`). The readers (`phase_counts`, `comm_steps`) are pure functions of the
compact log, usable in the parent without torch.distributed (`uses_collectives` too).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# a compact log entry: [kind, peer, nbytes, phase, state]
LogEntry = list


@dataclass
class Op:
    """One logged communication call on this rank."""

    index: int
    kind: str
    direction: str  # send / recv / collective
    peer: int | None  # global rank of the peer (None: a collective, or a receive from any rank)
    nbytes: int
    phase: str
    state: str = "posted"  # posted / deferred / waiting / done / dropped / failed
    peers: tuple[int, ...] | None = None  # a collective's group, as global ranks (when known)

    def label(self) -> str:
        """e.g. 'irecv from peer rank 2 (forward, op #3)', 'all_gather_into_tensor with peer ranks
        0, 1 (forward, op #0)'."""
        who = ""
        if self.direction != "collective":
            peer = "any" if self.peer is None else self.peer
            who = f" {'to' if self.direction == 'send' else 'from'} peer rank {peer}"
        elif self.peers:
            who = f" with peer ranks {', '.join(map(str, self.peers))}"
        return f"{self.kind}{who} ({self.phase}, op #{self.index})"

    def compact(self) -> LogEntry:
        """[kind, peer, bytes, phase, state]: the form the reply carries."""
        return [self.kind, self.peer, self.nbytes, self.phase, self.state]


def compact_log(ops: Iterable[Op]) -> list[LogEntry]:
    """The op log as small lists, in order."""
    return [o.compact() for o in ops]


def pending_text(rank: int, waiting: Op, pending: Iterable[Op]) -> str:
    """What a rank leaves on disk before it blocks: the op it waits on, then every other pending op
    (the pool puts this before the rank's stack in a hang report; judging reads the first line)."""
    lines = [f"rank {rank} last blocked waiting on {waiting.label()}"]
    lines += [f"  pending {o.label()} [{o.state}]" for o in pending if o is not waiting]
    return "\n".join(lines) + "\n"


_OPEN: dict[str, list[int]] = {}  # path -> [fd, the longest text written]
_OPEN_LOCK = threading.Lock()  # the main thread and the note's watcher both write


def forget(path: str) -> None:
    """Close the descriptor `overwrite` keeps for `path`, if any."""
    with _OPEN_LOCK:
        got = _OPEN.pop(path, None)
        if got is not None:
            os.close(got[0])


def overwrite(path: str, text: str, reopen: bool = False) -> None:
    """Replace a small file's text in place, padded with spaces (readers strip).

    The pending-ops note is written often, so the file stays open: open(path, "w") on ext4
    costs ~1 ms there (truncate + flush on close), open and close ~20 us, a pwrite a few.
    `reopen` opens the path afresh (a case's first write: the file may have been replaced)."""
    with _OPEN_LOCK:
        got = _OPEN.get(path)
        if got is not None and reopen:
            os.close(got[0])
            got = None
        if got is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            got = _OPEN[path] = [fd, os.fstat(fd).st_size]
        data = text.encode()
        try:
            os.pwrite(got[0], data.ljust(got[1]), 0)
        except OSError:
            _OPEN.pop(path, None)
            raise
        got[1] = max(got[1], len(data))


# a wait blocked this long leaves its note; a hang report comes seconds later
NOTE_AFTER_S = 0.05
# the wait this process's main thread is blocked in: (the note's writer,), or None
_BLOCKED: dict = {"wait": None, "pid": None}


def note_when_blocked(write: Callable[[], None]) -> None:
    """The main thread is about to wait. If it has not come to another wait NOTE_AFTER_S later
    (blocked in this one, or stuck after it), a watcher thread calls `write` once: the note of
    this wait and the ops pending then.

    Most waits are followed by another within milliseconds, and nothing is formatted or written:
    writing before every wait cost a few percent of a small case's rank CPU (docs/benchmarks.md,
    section 13)."""
    if _BLOCKED["pid"] != os.getpid():  # the watcher does not survive a fork
        _BLOCKED["pid"] = os.getpid()
        threading.Thread(target=_watch_blocked, daemon=True, name="pending-note").start()
    _BLOCKED["wait"] = (write,)


def unblocked() -> None:
    """No wait to note: the case is done, or a new one starts."""
    _BLOCKED["wait"] = None


def _watch_blocked() -> None:
    last = noted = None
    while True:
        time.sleep(NOTE_AFTER_S)
        wait = _BLOCKED["wait"]
        if wait is not None and wait is last and wait is not noted:
            try:
                wait[0]()
                noted = wait
            # best effort, tried again next time: the main thread may change the pending ops
            except Exception:  # noqa: BLE001
                pass
        last = wait


# -- readers of the compact log (parent side)
# ---------------------------------------------------------
def phase_counts(log: Sequence[Sequence]) -> dict[str, dict[str, int]]:
    """{phase: {kind: count}} of a compact op log (e.g. forward isend = W-1 for the reference
    ring)."""
    out: dict[str, Counter] = {}
    for kind, _peer, _nbytes, phase, _state in log:
        out.setdefault(phase, Counter())[kind] += 1
    return {p: dict(c) for p, c in out.items()}


P2P_KINDS = frozenset({"isend", "irecv", "send", "recv"})


def uses_collectives(comm: Mapping[int, Sequence[Sequence]]) -> bool:
    """Whether any rank's compact log (`comm`: rank -> log) holds a collective (P2P is logged as
    isend / irecv / send / recv, batch_isend_irecv included)."""
    return any(entry[0] not in P2P_KINDS for log in comm.values() for entry in log)


def comm_steps(
    comm: Mapping[int, Sequence[Sequence]],
    phase: str = "forward",
    kinds: tuple[str, ...] = ("isend", "send"),
) -> dict[int, int]:
    """Rank -> number of ops of `kinds` in `phase`, over every rank's compact log (`comm`: rank
    -> log, as a result's extra["comm"]). The reference ring makes W-1 K/V sends per rank in
    forward."""
    return {
        g: sum(1 for kind, _peer, _n, ph, _state in log if ph == phase and kind in kinds)
        for g, log in comm.items()
    }
