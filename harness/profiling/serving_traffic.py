"""What a decode over a sharded KV cache sends, against the least its merge form needs (#54).

Decode moves the queries and the partial results, never the cache. The least the busiest rank
sends, for its n own query rows of N (hq heads, head dim d, value head dim dv):

- queries: its rows to every other rank, (W - 1) n hq d in the input dtype; none when the
  queries are replicated;
- the all-gather merge: its partial of every row to every other rank, (W - 1) N hq (dv + 1)
  float32 numbers (out and lse);
- the all-to-all merge: each other rank's rows' partials once, (N - n) hq (dv + 1) float32.

Moving its KV share instead, as a pass-KV ring does, costs (W - 1) times the share. Collectives'
wire bytes are estimates (`traffic.wire_bytes`), so the figures are reported, never judged.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness import serving_case
from harness.case import Case, make_case
from harness.dtypes import TORCH_DTYPES
from harness.impls import registry
from harness.impls.capabilities import adapt
from harness.profiling.measure import profile_call
from harness.profiling.memory import kv_token_bytes
from harness.profiling.traffic import _rank_phase
from harness.ranks.protocol import Pool

FLOAT32 = 4


def decode_case(impl: str, w: int) -> Case:
    """A ragged decode batch, the KV interleaved by 16 tokens: its cache dwarfs its queries."""
    serving = {"context": [40 * w, 17 * w + 3, 9 * w], "new": [1, 1, 1], "kv": "interleaved",
               "interleave": 16}  # fmt: skip
    return make_case(
        world_size=w, serving=serving, mask={"kind": "causal"}, call="inference-mode",
        heads_q=4, heads_kv=2, head_dim=32, dtype="bf16", seed=7, impl=impl,
    )  # fmt: skip


@dataclass
class ServingTraffic:
    """The busiest rank's bytes in one decode call, and the least each merge form needs."""

    case: Case
    rank: int
    sent: int
    messages: int
    queries: int  # the least for its query rows
    all_gather: int  # queries + partials, all-gather merge
    all_to_all: int  # queries + partials, all-to-all merge
    kv_share: int  # what moving its KV share around the ring would send
    every: tuple[int, ...] = ()  # every rank's bytes sent, in rank order

    def line(self) -> str:
        kib = 1024
        moved = (
            f"the KV cache stayed put (moving it: {self.kv_share / kib:.1f} KiB)"
            if self.sent < self.kv_share
            else f"x{self.sent / self.kv_share:.2f} of moving its KV share "
            f"({self.kv_share / kib:.1f} KiB): the KV cache travelled"
        )
        each = ", ".join(f"{b / kib:.1f}" for b in self.every)
        return (
            f"decode at W{self.case.world_size} ({self.case.summary()}): the ranks sent {each} "
            f"KiB; rank {self.rank}, {self.sent / kib:.1f} KiB in {self.messages} messages, is ~x"
            f"{self.sent / self.all_gather:.2f} the all-gather merge's least "
            f"({self.all_gather / kib:.1f} KiB) and ~x{self.sent / self.all_to_all:.2f} the "
            f"all-to-all merge's ({self.all_to_all / kib:.1f} KiB); {moved}; reported, not judged"
        )

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "case"} | {"case": self.case.summary()}


def _least(c: Case, rank: int) -> tuple[int, int, int, int]:
    """(queries, all-gather, all-to-all, moving the KV share) bytes for `rank` of `c`."""
    w, hq, req = c.world_size, c.heads_q, c.serving
    rows = serving_case.query_positions(c)
    own, total = rows[rank].numel(), len(req.query_positions())
    item = TORCH_DTYPES[c.dtype].itemsize
    replicated = req.queries == "replicated"
    queries = 0 if replicated else (w - 1) * own * hq * c.head_dim * item * c.batch
    partial = hq * (c.dim_v + 1) * FLOAT32 * c.batch
    mine = total if replicated else own
    gather = queries + (w - 1) * total * partial
    to_all = queries + (total - mine // w if replicated else total - own) * partial
    kv = (w - 1) * c.seq_lens[rank] * kv_token_bytes(c)
    return queries, gather, to_all, kv


def serving_traffic(
    impl: str, pool: Pool, w: int, *, allow_import: bool = False
) -> ServingTraffic | None:
    """One profiled decode call at W = `w`, for a ring that declares decode; else None."""
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    if "decode" not in caps.shapes or w < 2:
        return None
    c = adapt(caps, decode_case(impl, w))
    if c is None or c.serving is None or c.world_size != w:
        return None
    call = profile_call(c, pool, impl, allow_import=allow_import)
    rows = [(_rank_phase(r.ops, r.events, "forward", w), r.rank) for r in call.ranks]
    (sent, messages, _rounds, _estimated), rank = max(rows)
    every = tuple(r[0][0] for r in sorted(rows, key=lambda r: r[1]))
    return ServingTraffic(c, rank, sent, messages, *_least(c, rank), every=every)
