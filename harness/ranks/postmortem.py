"""What a dead or hung rank left behind, and how a rank's process group is ended.

Each rank writes to files in the pool's private dir. Its log holds faulthandler's report after a
fatal signal. A hung rank dumps its Python stack on SIGUSR1. Its fault interposer leaves a note of
the faults that fired and of the ops in flight when it last blocked. The functions here read those
files for the pool's reports. Each worker runs in its own session: it is ended as a group, SIGTERM
first, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from harness import interrupt
from harness.ranks import oom

STACK_GRACE_S = 1.0  # a hung rank's time to dump its stack after SIGUSR1
TERM_GRACE_S = 2.0  # a worker's time to exit after SIGTERM before SIGKILL
REAP_TIMEOUT_S = 5.0  # a SIGKILLed worker is reaped within this, or directly (`_reap`)


# -- reading what a rank left -------------------------------------------------------------------


def fault_note(workdir: str | None, r: int, case_id: int | None) -> dict | None:
    """The note rank r's fault interposer left (faults fired, a scheduled crash) before it died."""
    try:
        with open(os.path.join(workdir, f"faults-{r}")) as f:
            note = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return note if isinstance(note, dict) and note.get("case_id") == case_id else None


def pending_ops(workdir: str | None, r: int) -> str:
    """The ops rank r had in flight when it last blocked (written by its fault interposer)."""
    try:
        with open(os.path.join(workdir, f"pending-{r}"), errors="replace") as f:
            return f.read().strip()
    except (OSError, TypeError):
        return ""


def stack_size(workdir: str | None, r: int) -> int:
    """The size of rank r's stack file now: a later dump is read from this offset on."""
    try:
        return os.path.getsize(os.path.join(workdir, f"stack-{r}.txt"))
    except OSError:
        return 0


def stacks(
    workdir: str | None, procs: list[subprocess.Popen], ranks: list[int], offsets: dict[int, int]
) -> dict[int, str]:
    """Ask each hung rank for its Python stack (faulthandler on SIGUSR1) and read it."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACK_GRACE_S)
    out = {}
    for r in ranks:
        try:
            with open(os.path.join(workdir, f"stack-{r}.txt"), errors="replace") as f:
                f.seek(offsets.get(r, 0))
                out[r] = f.read().strip() or "(no stack dumped)"
        except OSError:
            out[r] = "(no stack file)"
        ops = pending_ops(workdir, r)
        if ops:
            out[r] = f"pending ops: {ops}\n{out[r]}"
    return out


def death(workdir: str | None, r: int, proc: subprocess.Popen) -> str:
    """How rank r died (for SIGKILL, the likely cause: harness.ranks.oom) and its log's tail."""
    return oom.describe(r, proc, log_tail(workdir, r))


def log_tail(workdir: str | None, r: int, n: int = 600) -> str:
    """The log's last `n` characters; after a fatal signal, faulthandler's report of where it
    struck."""
    try:
        text = Path(workdir, f"log-{r}.txt").read_text(errors="replace").strip()
    except (OSError, TypeError):
        return "(no log)"
    crash = fatal_frames(text)
    return crash or (text[-n:].replace("\n", " | ") if text else "(empty log)")


def fatal_frames(log: str, frames: int = 6) -> str:
    """'Fatal Python error: Segmentation fault; File ... <- File ...' from the last faulthandler
    report in a rank's log, innermost frame first; '' when the log has none."""
    i = log.rfind("Fatal Python error")
    if i < 0:
        return ""
    lines = [ln.strip() for ln in log[i:].splitlines() if ln.strip()]
    blocks: list[list[str]] = []
    for ln in lines[1:]:
        if ln.startswith(("Current thread", "Thread ")):
            blocks.append([ln])
        elif ln.startswith("File ") and blocks:
            blocks[-1].append(ln)
    # the crashing thread, or (when it has no Python frame: a backend's own thread) the deepest
    # other one
    blocks.sort(key=lambda b: (not (b[0].startswith("Current thread") and len(b) > 1), -len(b)))
    kept = next((b[1:] for b in blocks if len(b) > 1), [])
    return f"{lines[0]}; " + (" <- ".join(kept[:frames]) if kept else "no Python frame")


# -- ending process groups ------------------------------------------------------------------


def kill_all(procs: list[subprocess.Popen], workdir: str | None) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is left; remove the temp dir (always,
    even when killing raised)."""
    try:
        kill_groups(procs)
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def signal_groups(procs: list[subprocess.Popen], sig: int) -> None:
    """Send `sig` to the process group of every worker still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def kill_groups(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, a grace of TERM_GRACE_S (less when a stop was requested: nobody waits for their
    results), then SIGKILL what is left."""
    signal_groups(procs, signal.SIGTERM)
    end = time.monotonic() + (TERM_GRACE_S if interrupt.requested() is None else 0.5)
    for p in procs:
        try:
            p.wait(timeout=max(0.01, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _reap(p)


def _reap(p: subprocess.Popen) -> None:
    """Wait for a SIGKILLed worker, with a deadline. A SIGTERM the CLI raises as an exception can
    land inside one of Popen's own calls and leave its waitpid lock held; an unbounded `p.wait()`
    then blocks forever (seen: a check interrupted under load hung in close for 34 min, its other
    pool's workers alive). Past the deadline the worker (dead: SIGKILL) is reaped with os.waitpid
    directly, without that lock."""
    try:
        p.wait(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except ChildProcessError:
            pass
