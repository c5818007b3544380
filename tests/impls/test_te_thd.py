"""`te-cp-p2p-thd`: TE's packed-document (THD) context parallelism. TE needs a GPU; what is ours
runs here: the packing (documents x batch as padded sequences), TE's dual-chunk partition as its
tests state it, and the resharding between our layouts and that partition, end to end on gloo ranks
around a stand-in for TE's kernel (tests/helpers/te_thd.py), judged by the harness like any
implementation."""

from __future__ import annotations

import torch

from harness.case import make_case
from harness.impls.adapters import te_cp
from harness.runner import run_case
from ring_impl.masks import MaskSpec

STANDIN, ONE_SHORT = "tests.helpers.te_thd:standin", "tests.helpers.te_thd:one_short"


def test_dual_chunk_rows_are_tes_own_expected_partition():
    """TE's test_cp_utils.py: cu_seqlens [0, 8, 16], W=2 -> rank 0 rows [0,1,6,7,8,9,14,15], rank 1
    the rest."""
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert te_cp.dual_chunk_rows(cu, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert te_cp.dual_chunk_rows(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    rows = torch.cat([te_cp.dual_chunk_rows(cu, 16, 4, r) for r in range(4)])
    assert sorted(rows.tolist()) == list(range(16))


def test_packing_pads_every_document_of_every_batch_row_to_2w():
    pack = te_cp.thd_packing(
        MaskSpec("document", doc_starts=(0, 3, 8), causal=True), 10, 2, 2, torch.device("cpu")
    )
    assert pack.cu_seqlens.tolist() == [0, 3, 8, 10, 13, 18, 20]
    assert pack.cu_seqlens_padded.tolist() == [0, 4, 12, 16, 20, 28, 32]
    assert pack.rows.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12, 13] + [
        16,
        17,
        18,
        20,
        21,
        22,
        23,
        24,
        28,
        29,
    ]
    assert pack.causal and pack.cu_seqlens.dtype == torch.int32
    even = te_cp.thd_packing(MaskSpec("none"), 8, 1, 2, torch.device("cpu"))
    assert even.cu_seqlens_padded is even.cu_seqlens and not even.causal  # no padding: TE sees none


def test_thd_masks_and_layouts_declared():
    caps = te_cp.VARIANTS["te-cp-p2p-thd"].capabilities
    assert caps.masks == {"none", "causal", "document"} and caps.layouts == {
        "contiguous",
        "zigzag",
        "striped",
    }
    assert caps.devices == {"cuda"}


POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)


def _cases():
    # lengths 5, 4, 3: padded for W 2 and 3
    docs = MaskSpec("document", doc_starts=(0, 5, 9), causal=True)
    out = []
    for world_size, per_rank in ((2, 7), (3, 5)):
        for layout in ("contiguous", "zigzag", "striped"):
            for mask in (
                docs,
                MaskSpec("document", doc_starts=(0, 5, 9)),
                MaskSpec("causal"),
                MaskSpec("none"),
            ):
                out.append(
                    make_case(
                        world_size=world_size,
                        seq_lens=(per_rank,) * world_size,
                        layout=layout,
                        mask=mask,
                        dtype="bf16",
                        batch=2,
                        heads_q=4,
                        heads_kv=2,
                        head_dim=8,
                        seed=len(out),
                    )
                )
    return out


def test_the_resharding_around_tes_partition_passes_the_judge(pool):
    """Every layout at W 2 and 3, documents (padded) with and without causal, causal, no mask, batch
    2, GQA: out, dq, dk, dv through the packing, TE's partition and back equal the float64 oracle
    within the bound."""
    for case in _cases():
        res = run_case(case, pool, STANDIN, allow_import=True)
        assert res.verdict == "pass", (
            case.describe() if hasattr(case, "describe") else case,
            res.verdict,
            res.detail,
        )


def test_a_sequence_taken_one_token_short_is_caught(pool):
    """The class of TE #1930 (a length-7 sequence treated as 6: its last token dropped) fails the
    judge."""
    verdicts = {run_case(c, pool, ONE_SHORT, allow_import=True).verdict for c in _cases()[:4]}
    assert "pass" not in verdicts, verdicts
