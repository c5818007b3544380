"""Mutants wrong only for some values of one case feature: the world size, the split, the rank.

Each fails on many cases that share one feature and passes on the rest. They are what the report's
grouping and its shared-feature line are measured on (`ring-harness bench report`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ring_impl.masks import MaskSpec
from ring_impl.mutants.base import mask_changes, mutant
from ring_impl.ring import BlockAt, position_mask


def power_of_two_steps(world_size: int) -> int:
    """Ring steps rounded down to a power of two, as a recursive-doubling schedule counts them."""
    return 1 << (world_size.bit_length() - 1)


def lengths_from_three_ranks(lengths: Sequence[int]) -> list[int]:
    """K/V lengths. On three or more ranks with uneven shards, the last rank raises the error a
    `torch.cat` of unequal shards gives; the others are left waiting for it mid-ring."""
    lengths = list(lengths)
    uneven = len(lengths) >= 3 and len(set(lengths)) > 1
    if uneven and dist.is_initialized() and dist.get_rank() == len(lengths) - 1:
        raise RuntimeError(
            "Sizes of tensors must match except in dimension 1. "
            f"Expected size {lengths[0]} but got size {lengths[-1]} for tensor number 1 in the list."
        )
    return lengths


def unmasked_on_last_rank(
    spec: MaskSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, at: BlockAt
) -> torch.Tensor | None:
    """The reference's mask, except the last rank's own block on W >= 2: no mask at all."""
    if at.world_size > 1 and at.rank == at.world_size - 1 and at.owner == at.rank:
        return None
    return position_mask(spec, q_pos, k_pos, at)


steps_rounded_to_power_of_two = mutant(
    "steps-rounded-to-power-of-two",
    """Runs 2**floor(log2 W) ring steps, as a schedule written for recursive doubling would (no
    single public report: peer suites test W = 2, 4, 8 only). Right at W = 1, 2, 4, 8; at W = 3, 5,
    6, 7 each rank skips the blocks of its last owners. Visible at world sizes that are not powers
    of two, for any mask that lets a query see a skipped block.""",
    steps=power_of_two_steps,
)

uneven_split_crash_from_three = mutant(
    "uneven-split-crash-from-three",
    """Raises on one rank on uneven splits at W >= 3 (a `torch.cat` of K/V shards that assumes
    equal lengths, reached only past two ranks; no single public report, EasyContext #10 is the
    silent kind); the other ranks wait for it. Right on even splits and at W <= 2. Visible as a
    fail-stop on uneven cases with three or more ranks.""",
    kv_lengths=lengths_from_three_ranks,
)

last_rank_own_block_unmasked = mutant(
    "last-rank-own-block-unmasked",
    """The last rank computes its own (diagonal) block without a mask, as code that special-cases
    the rank holding the sequence's end would (no single public report). Every other rank is
    right. Visible on the last rank at W >= 2 under any mask that hides part of that block
    (causal, window, document).""",
    **mask_changes(unmasked_on_last_rank),
)
