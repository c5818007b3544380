"""The memory class: does a rank's peak grow with the global length n, or only with its own n/W?

Two sweeps read it. Each gives the K/V copies of every global token a rank holds. Both are
judged, with one threshold. A ring keeps the promise only if neither says O(n).

The W sweep runs a fixed number of tokens a rank at W = 1, 2, 4, 8: n grows with W. A ring's peak
per rank then stays flat. A ring that gathers K and V holds a copy of every rank's keys: its peak
grows by at least the K/V bytes of each global token. The slope is read between the two largest
ring sizes, where O() shows: the peak's growth per global token over one token's K/V bytes is the
share of a global K/V copy a rank holds. It is about 0 for a ring (the global positions only) and
1 or more for an all-gather. Smaller W are shown, not read: many rings take another path there
(torch's all-to-all ring grows by 112 KiB from W = 1 to 2 and 33 KiB to W = 4, then stays flat).

The length sweep runs the same two ring sizes at t, 2t and 4t tokens a rank. At one W, n/W and n
grow together. So one W's slope cannot tell them apart. A ring's own peak grows fast with n/W. It
holds q, out, the gradients and the K/V blocks in flight. The reference's score blocks grow with
(n/W)^2. At W = 4 the reference grows 8.8 K/V copies per added global token. The README's all-gather
ring grows 3.3 to 3.5. So the larger W's growth is set against the smaller W's, over the same tokens
a rank. Each is a least-squares line over the lengths. What grows with n/W is alike at both and
cancels. What is left grows with n: the held copies. A constant that depends on W cancels too,
unlike in the W sweep. docs/promises.md has the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.profiling.measure import LIVE_BYTES

GATHERS = 0.75  # a rank that holds this share of a K/V copy of every global token gathers K/V
UNKNOWN = "unknown (needs two ring sizes >= 2)"


def kv_token_bytes(c: Case) -> int:
    """Bytes of one token's K and V (all kv heads, the whole batch) in the input dtype.

    V has the value head dim (MLA), K the query/key one.
    """
    return c.batch * c.heads_kv * (c.head_dim + c.dim_v) * TORCH_DTYPES[c.dtype].itemsize


def verdict(held: float | None) -> str:
    """The memory class of a rank that holds `held` K/V copies of each global token."""
    if held is None:
        return UNKNOWN
    return "O(n): gathers K/V" if held >= GATHERS else "O(n/W)"


@dataclass
class LengthSweep:
    """Peak bytes per rank (the largest over ranks) at two W, over growing tokens a rank."""

    tokens: list[int]  # tokens a rank, ascending
    peaks: dict[int, list[int]]  # W -> bytes at each of `tokens`
    kv_bytes: dict[int, int]  # W -> one token's K and V bytes, as in MemoryClass

    def _slopes(self) -> tuple[int, int, dict[int, float]] | None:
        """The two W, and each W's peak growth per added token a rank, in K/V tokens. Each is a
        least-squares line over every length. None below two W or two lengths."""
        ws = sorted(self.peaks)[-2:]
        if len(ws) < 2 or len(self.tokens) < 2:
            return None
        mean = sum(self.tokens) / len(self.tokens)
        dx = [t - mean for t in self.tokens]
        slope = {
            w: sum(d * p for d, p in zip(dx, self.peaks[w], strict=True))
            / (sum(d * d for d in dx) * self.kv_bytes[w])
            for w in ws
        }
        return ws[0], ws[1], slope

    @property
    def growth(self) -> float | None:
        """The larger W's growth per added global token, in K/V copies: n/W's share and n's."""
        s = self._slopes()
        return None if s is None else s[2][s[1]] / s[1]

    @property
    def held_copies(self) -> float | None:
        """The share of that growth that grows with n, not n/W: K/V copies of each global token."""
        s = self._slopes()
        if s is None:
            return None
        lo, hi, slope = s
        return (slope[hi] - slope[lo]) / (hi - lo)

    @property
    def verdict(self) -> str:
        return verdict(self.held_copies)

    def line(self) -> str:
        ws = sorted(self.peaks, reverse=True)  # the larger W first: its growth is the one read
        kib = "; ".join(f"W{w} " + ", ".join(f"{p / 1024:.0f}" for p in self.peaks[w]) for w in ws)
        tokens = ", ".join(map(str, self.tokens))
        said = (
            f"memory over length {self.verdict}: peak KiB per rank at {tokens} tokens a rank: {kib}"
        )
        held, growth = self.held_copies, self.growth
        if held is None or growth is None:
            return said
        return (
            f"{said}; fitted over those lengths, W{ws[0]} grows {growth:.2f} K/V copies per "
            f"added global token: {held:.2f} with n, "
            f"{growth - held:.2f} with n/W as at W{ws[1]}"
        )


@dataclass
class MemoryClass:
    """Peak bytes per rank (the largest over ranks) at each W, at a fixed length a rank: live
    tensor bytes, or the device allocator's on CUDA ranks (`instrument`)."""

    tokens_per_rank: int
    peaks: dict[int, int]  # W -> bytes
    # W -> one token's K and V bytes. An adapter may change the heads with W (Ulysses needs W to
    # divide them), so each W's peak is read in K/V tokens of its own case.
    kv_bytes: dict[int, int]
    length: LengthSweep | None = None  # the length sweep, when it ran
    instrument: str = LIVE_BYTES  # what measured the peaks (harness.profiling.measure)

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
        """The W sweep's verdict."""
        return verdict(self.held_copies)

    def broken(self) -> list[str]:
        """Each sweep that says O(n), in words. Unknown is not judged."""
        out = [f"memory {self.verdict}"] if self.verdict.startswith("O(n):") else []
        if self.length is not None and self.length.verdict.startswith("O(n):"):
            out.append(f"memory over length {self.length.verdict}")
        return out

    @property
    def kept(self) -> bool:
        """Neither sweep says O(n). Unknown is not judged (fewer than two ring sizes >= 2)."""
        return not self.broken()

    def line(self) -> str:
        ws = sorted(self.peaks)
        peaks = ", ".join(f"W{w} {self.peaks[w] / 1024:.0f}" for w in ws)
        held = self.held_copies
        fit = "" if held is None else f"; it holds {held:.2f} K/V copies of each global token"
        return (
            f"memory {self.verdict}: peak KiB per rank at {self.tokens_per_rank} tokens a rank: "
            f"{peaks}{fit}; peak: {self.instrument}"
        )

    def to_json(self) -> dict:
        out = {
            "verdict": self.verdict,
            "peaks": self.peaks,
            "held_copies": self.held_copies,
            "instrument": self.instrument,
        }
        if self.length is not None:
            s = self.length
            out["length"] = {
                "verdict": s.verdict,
                "tokens_per_rank": s.tokens,
                "peaks": s.peaks,
                "growth_copies": s.growth,
                "held_copies": s.held_copies,
            }
        return out
