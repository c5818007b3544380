"""The memory class: does a rank's peak grow with the global length n, or only with its own n/W?

The calls run at a fixed number of tokens a rank, at W = 1, 2, 4, 8: n grows with W. A ring's peak
per rank then stays flat. A ring that gathers K and V holds a copy of every rank's keys: its peak
grows by at least the K/V bytes of each global token. The slope is read between the two largest
ring sizes, where O() shows: the peak's growth per global token over one token's K/V bytes is the
share of a global K/V copy a rank holds. It is about 0 for a ring (the global positions only) and
1 or more for an all-gather. Smaller W are shown, not read: many rings take another path there
(torch's all-to-all ring grows by 112 KiB from W = 1 to 2 and 33 KiB to W = 4, then stays flat).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.case import Case
from harness.dtypes import TORCH_DTYPES

GATHERS = 0.75  # a rank that holds this share of a K/V copy of every global token gathers K/V


def kv_token_bytes(c: Case) -> int:
    """Bytes of one token's K and V (all kv heads, the whole batch) in the input dtype."""
    return 2 * c.batch * c.heads_kv * c.head_dim * TORCH_DTYPES[c.dtype].itemsize


@dataclass
class MemoryClass:
    """Peak live bytes per rank (the largest over ranks) at each W, at a fixed length a rank."""

    tokens_per_rank: int
    peaks: dict[int, int]  # W -> bytes
    # W -> one token's K and V bytes. An adapter may change the heads with W (Ulysses needs W to
    # divide them), so each W's peak is read in K/V tokens of its own case.
    kv_bytes: dict[int, int]

    @property
    def held_copies(self) -> float | None:
        """The peak's growth per global token between the two largest W >= 2, in K/V copies;
        None below two such W."""
        ws = sorted(w for w in self.peaks if w >= 2)[-2:]
        if len(ws) < 2:
            return None
        lo, hi = ws
        tokens = {w: self.peaks[w] / self.kv_bytes[w] for w in ws}  # the peak in K/V tokens
        return (tokens[hi] - tokens[lo]) / ((hi - lo) * self.tokens_per_rank)

    @property
    def verdict(self) -> str:
        held = self.held_copies
        if held is None:
            return "unknown (needs two ring sizes >= 2)"
        return "O(n): gathers K/V" if held >= GATHERS else "O(n/W)"

    @property
    def kept(self) -> bool:
        """Not O(n). Unknown is not judged (fewer than two ring sizes >= 2)."""
        return not self.verdict.startswith("O(n):")

    def line(self) -> str:
        ws = sorted(self.peaks)
        peaks = ", ".join(f"W{w} {self.peaks[w] / 1024:.0f}" for w in ws)
        held = self.held_copies
        fit = "" if held is None else f"; it holds {held:.2f} K/V copies of each global token"
        return (
            f"memory {self.verdict}: peak KiB per rank at {self.tokens_per_rank} tokens a rank: "
            f"{peaks}{fit}"
        )
