"""What each fault kind does to a tensor or to the process: poison, bit flips, delays, crashes.

Plain functions with no torch.distributed state, so they can be unit-tested in one process. Every
random choice comes from `rng_for` (seeded by case seed, fault, rank and op), so a case replays
the same faults exactly.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable

import torch

from harness.faults.schema import FaultSpec


def rng_for(seed: int, spec: FaultSpec, rank: int, op_index: int) -> random.Random:
    """The deterministic RNG of one fault on one rank at one op (string seeds hash stably)."""
    return random.Random(f"ring-harness:{seed}:{spec.fid}:{rank}:{op_index}")


def poison(t: torch.Tensor) -> None:
    """Fill a buffer that must not be read yet: NaN for floats, the largest value for integers."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe), used to see whether a send buffer changed in flight."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def flip_bits(
    t: torch.Tensor, rng: random.Random, bit: int | None = None, count: int = 1
) -> list[tuple[int, int]]:
    """Flip one bit in each of `count` seeded elements of `t` in place; returns (element, bit)
    pairs."""
    n = t.numel()
    if n == 0:
        return []
    target = t if t.is_contiguous() else t.contiguous()
    raw = target.view(-1).view(torch.uint8)
    size = t.element_size()
    flips = []
    for elem in rng.sample(range(n), min(count, n)):
        b = (bit if bit is not None else rng.randrange(size * 8)) % (size * 8)
        pos = elem * size + (b // 8 if sys.byteorder == "little" else size - 1 - b // 8)
        raw[pos] ^= 1 << (b % 8)
        flips.append((elem, b))
    if target is not t:
        t.copy_(target)
    return flips


def delay_seconds(spec: FaultSpec, rng: random.Random) -> float:
    """Fixed delay plus a seeded jitter in [0, jitter)."""
    return spec.seconds + (rng.uniform(0.0, spec.jitter) if spec.jitter > 0 else 0.0)


def sleep(seconds: float) -> None:
    """Sleep for a fault's delay (nothing for zero or less)."""
    if seconds > 0:
        time.sleep(seconds)


def write_note(path: str, note: dict) -> None:
    """Atomically leave a small JSON note (what fired) that outlives the process."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(note, f)
        os.replace(tmp, path)
    except OSError:
        pass


def crash(
    how: str, note: dict, path: str | None, exit_fn: Callable[[int], None] | None = None
) -> None:
    """Die now, as scheduled: leave a note (file + log line) saying where, then exit 0, exit 1 or
    SIGKILL."""
    if path:
        write_note(path, note)
    sys.stdout.write(
        f"ring-harness fault: crash ({how}) at {note.get('crash', note).get('op', '?')}\n"
    )
    sys.stdout.flush()
    if exit_fn is not None:  # tests: don't kill the test process
        exit_fn({"exit0": 0, "exit1": 1, "sigkill": -signal.SIGKILL}[how])
        return
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(5)  # the signal is delivered before this returns
    os._exit(0 if how == "exit0" else 1)
