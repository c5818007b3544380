"""One rank's share of the oracle for a case: its rows pass and its keys pass.

Share g is the positions rank g holds under the case's layout: its query rows and its keys, which a
serving case tells apart (`harness.serving_case`). `share_rows` and `share_keys` run
the two passes (`rows_pass`, `keys_pass`) for a case on a rank's device. `case_fetch` makes the
case's inputs from its seed for any positions. docs/oracle.md has the derivation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness import inputs
from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.inputs import FLASH_BASE_VALUES
from harness.oracle import tiles
from harness.oracle.keys_pass import keys_part
from harness.oracle.parts import Fetch, KeysPart, RowsPart, RowStats
from harness.oracle.rows_pass import rows_part
from harness.oracle.tile_store import rows_store
from harness.oracle.tiles import key_positions, positions, trimmer
from harness.oracle.variant import variant_of
from harness.serving_case import mask_of

WHOLE_INPUTS_BYTES = 16 << 20  # a case whose four global inputs fit here makes each once
# the last small case's whole inputs: both passes, every local share
_WHOLE: dict = {"key": None, "tensors": {}}


def case_fetch(case: Case, device="cpu") -> Fetch:
    """Inputs of the case made from its seed for any positions, on `device`.

    The sweeps ask for every block again and again. A small case makes each whole tensor once,
    keeps it for the case's next pass or share in this process, and indexes it: inputs are made
    per token, so the values are the same. A long case makes each block when asked and keeps
    nothing."""
    size = 4 * case.batch * case.total_len * case.heads_q * max(case.head_dim, case.dim_v) * 4
    if size > WHOLE_INPUTS_BYTES:
        return lambda name, pos: inputs.make(case, name, pos).to(device)
    if _WHOLE.get("case") is not case or _WHOLE.get("device") != str(device):
        key = (case.replace(impl="-", faults=(), tolerance={}, deadline_s=1.0).key(), str(device))
        if _WHOLE["key"] != key:
            _WHOLE.update(key=key, tensors={})
        # the same case object asks again for its next share or pass: no key to compute
        _WHOLE.update(case=case, device=str(device))
    whole = _WHOLE["tensors"]

    def fetch(name: str, pos: torch.Tensor) -> torch.Tensor:
        if name not in whole:
            whole[name] = inputs.make(case, name, torch.arange(case.total_len)).to(device)
        return whole[name][:, pos.to(device)]

    return fetch


def _work(case: Case) -> int:
    """Score entries of the largest share's pass: batch x query heads x its positions x every
    position."""
    return case.batch * case.heads_q * case.total_len * max(case.seq_lens, default=0)


def share_rows(case: Case, index: int, device="cpu") -> tuple[RowsPart, RowsPart]:
    """(float64, base) rows passes of share `index`, computed on `device`, returned on the CPU."""
    # what the rank's run left in glibc's heap goes back first: a long share's peak is its own
    trimmer(_work(case))(0)
    parts = rows_part(
        case_fetch(case, device),
        positions(case, index),
        [g.pos for g in tiles.key_groups(case)],
        case.heads_kv,
        mask_of(case),
        case.scale,
        TORCH_DTYPES[case.dtype],
        tiles.block(case),
        case.values in FLASH_BASE_VALUES,
        variant_of(case),
        rows_store(_work(case)),  # no gradient tiles: the keys pass runs later, on every share
    )
    return tuple(p.cpu() for p in parts)


def share_keys(
    case: Case, index: int, stats: Sequence[RowStats], device="cpu"
) -> tuple[KeysPart, KeysPart]:
    """(float64, base) keys passes of share `index` given every row's (float64, base) statistics."""
    trimmer(_work(case))(0)
    parts = keys_part(
        case_fetch(case, device),
        key_positions(case, index),
        index,
        tiles.blocks(case),
        tiles.key_groups(case),
        case.heads_kv,
        stats,
        mask_of(case),
        case.scale,
        TORCH_DTYPES[case.dtype],
        case.values in FLASH_BASE_VALUES,
        variant_of(case),
    )
    return tuple(p.cpu() for p in parts)
