"""Deterministic tensors from a case's seed, built per token: a rank makes only its own shard.

The values for token block b of tensor `name` come from a generator seeded by (seed, name, b). So
the parent's global tensors and each rank's shard agree bit for bit. No rank ever materialises the
global q, k, v or dout.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from harness.case import Case
from harness.dtypes import EXACT_INTEGERS, TORCH_DTYPES

TOKEN_BLOCK = 64
NAMES = ("q", "k", "v", "dout")
# "large": q and k scaled so that scaled scores have magnitudes of roughly 50-200, stressing the
# log-sum-exp merge; "near-tie": keys nearly identical so softmax rows are close to uniform.
LARGE_GAIN = 10.0
NEAR_TIE_NOISE = 1e-3
# The magnitudes of trained models (their evidence: docs/tolerance.md, "Values of trained models").
# "outliers": a few channels of q, k and v carry values OUTLIER_GAIN times the others.
OUTLIER_GAIN = 10.0
OUTLIER_SHARE = 8  # one channel in 8, at least one
# "qk-overflow": one channel of q and of k holds a shared constant, so that every raw product q.k
# passes fp16's largest value while the scaled logits stay below half of it. The shift is the same
# for all keys.
FP16_MAX = 65504.0
OVERFLOW_PRODUCT = 1.25 * FP16_MAX
# "sink": the first token's key dominates every row that sees it (logits ~SINK_LOGIT above the rest)
# and its value is small, as attention sinks are
SINK_LOGIT = 8.0
SINK_VALUE = 0.05


@functools.lru_cache(maxsize=1 << 16)
def _block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of one block of one tensor (numpy's SeedSequence: ~30 us, so kept)."""
    ss = np.random.SeedSequence([seed & (2**63 - 1), NAMES.index(name) + 1, block])
    return int(ss.generate_state(1, dtype=np.uint64)[0] & (2**63 - 1))


def dim_of(case: Case, name: str) -> int:
    """The head dim of tensor `name`: v and dout (and out) have the value head dim."""
    return case.dim_v if name in ("v", "dout") else case.head_dim


def _raw(case: Case, name: str, positions: torch.Tensor, heads: int) -> torch.Tensor:
    """float32 (batch, len(positions), heads, dim) standard normal values for those tokens.

    A plain case's v has head_dim entries, so its values are those of every earlier release. A
    value head dim of its own draws the same generator for its own width.
    """
    dim = dim_of(case, name)
    out = torch.empty(case.batch, positions.numel(), heads, dim, dtype=torch.float32)
    if positions.numel() == 0:
        return out
    blocks = torch.div(positions, TOKEN_BLOCK, rounding_mode="floor")
    for b in torch.unique(blocks).tolist():
        gen = torch.Generator().manual_seed(_block_seed(case.seed, name, b))
        block = torch.randn(case.batch, TOKEN_BLOCK, heads, dim, generator=gen)
        sel = (blocks == b).nonzero().view(-1)
        out[:, sel] = block[:, positions[sel] - b * TOKEN_BLOCK]
    return out


def make(case: Case, name: str, positions: torch.Tensor) -> torch.Tensor:
    """Tensor `name` (q, k, v or dout) for the given global positions, in the case's dtype."""
    heads = case.heads_kv if name in ("k", "v") else case.heads_q
    x = _raw(case, name, positions, heads)
    if case.values == "large" and name in ("q", "k"):
        x = x * LARGE_GAIN
    elif case.values == "near-tie" and name == "k":
        # one shared key per (batch, head) plus tiny per-token noise
        shared = _raw(case, name, torch.zeros(1, dtype=torch.long), heads)
        x = shared.expand_as(x) + NEAR_TIE_NOISE * x
    elif case.values in TRAINED:
        x = TRAINED[case.values](case, name, positions, x)
    return x.to(TORCH_DTYPES[case.dtype])


def outlier_channels(head_dim: int) -> slice:
    """The channels that carry outliers: the last ones, fixed so that every rank and the oracle
    agree.
    """
    n = max(1, head_dim // OUTLIER_SHARE)
    return slice(head_dim - n, head_dim)


def _outliers(case: Case, name: str, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if name in ("q", "k", "v"):
        x[..., outlier_channels(dim_of(case, name))] *= OUTLIER_GAIN
    return x


def overflow_shift(case: Case) -> float:
    """The constant that q and k each hold in their last channel.

    Its square passes fp16's largest value. Times the softmax scale, it stays below half of it. A
    large scale or a tiny head_dim lowers the product.
    """
    return min(OVERFLOW_PRODUCT, 0.5 * FP16_MAX / case.scale) ** 0.5


def _qk_overflow(case: Case, name: str, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if name in ("q", "k"):
        x[..., -1] = overflow_shift(case)
    return x


def _sink(case: Case, name: str, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Make the first token an attention sink.

    Every query leans along one direction u, the last channel. The first token's key is u, grown
    until its logit is SINK_LOGIT above the others. Its value shrinks to SINK_VALUE of the others'.
    """
    first = positions == 0
    if name == "q":
        x[..., -1] = 1.0  # one unit along u
    elif name == "k" and bool(first.any()):
        x[:, first] = 0.0
        x[:, first, :, -1] = SINK_LOGIT / case.scale
    elif name == "v" and bool(first.any()):
        x[:, first] *= SINK_VALUE
    return x


TRAINED = {"outliers": _outliers, "qk-overflow": _qk_overflow, "sink": _sink}
# Values on which plain attention in a 16-bit dtype is no correct computation: its raw q.k overflows
# fp16 and, in bf16, rounds the shift to steps larger than the logits' spread. The oracle's base
# keeps those scores in float32, as flash kernels do (harness.oracle.numerics.ScoreRounding,
# docs/oracle.md).
FLASH_BASE_VALUES = ("qk-overflow",)


def make_global(case: Case) -> dict[str, torch.Tensor]:
    """All four global tensors, for the parent's oracle."""
    pos = torch.arange(case.total_len, dtype=torch.long)
    return {n: make(case, n, pos) for n in NAMES}


def leak_queries(case: Case) -> torch.Tensor:
    """Query positions S for the causality-leak check.

    They are one or two short random runs of tokens. A third run lies beyond the dtype's exact
    integers when the sequence passes them. There, a position computed in the input dtype rounds,
    and a query that sees a future key leaks.

    Short runs make most keys invisible under causal, window and document masks, so a leak shows.
    """
    n = case.total_len
    gen = torch.Generator().manual_seed(_block_seed(case.seed, "dout", 2**31))
    picks = []
    for _ in range(2 if n > 4 else 1):
        start = int(torch.randint(0, n, (1,), generator=gen))
        length = int(torch.randint(1, 4, (1,), generator=gen))
        picks.append(torch.arange(start, min(n, start + length)))
    exact = EXACT_INTEGERS[case.dtype]
    # Drawn after the runs above, so cases within the exact integers keep theirs.
    if n > exact + 4:
        start = int(torch.randint(exact, n - 3, (1,), generator=gen))
        picks.append(torch.arange(start, start + 3))
    return torch.unique(torch.cat(picks))
