"""Bug variants of the reference ring, each a few RingParts away from it; never imported by
ring_impl.

MUTANTS maps a kebab-case bug name to a function with the `ring_attention` signature; each
function's docstring cites the public report it reproduces and when the bug is visible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ring_impl.mutants import (
    by_feature,
    calls,
    collective_comm,
    comm,
    grads,
    history,
    mask_language,
    masks,
    merges,
    precision,
    scale,
    serving,
    shapes,
    variants,
)

_ALL = [
    merges.naive_merge_sum,
    merges.overflow_merge,
    merges.overwrite_merge,
    masks.causal_step_off_by_one,
    masks.diagonal_mask_every_step,
    comm.group_local_peer,
    grads.dkv_no_final_hop,
    grads.dkv_one_rank_off,
    grads.stale_kv_backward,
    grads.dq_through_bf16,
    merges.low_precision_accumulator,
    shapes.uneven_tail_dropped,
    masks.zigzag_second_half_order,
    masks.striped_diagonal_offset,
    shapes.gqa_repeat,
    shapes.scale_one_over_d,
    masks.window_off_by_one,
    masks.document_leak_across_ranks,
    comm.read_before_wait,
    comm.send_buffer_overwrite,
    comm.skipped_ring_step,
    precision.out_merge_in_input_dtype,
    precision.dq_accumulate_in_input_dtype,
    precision.dkv_travel_in_input_dtype,
    history.dkv_cache_not_zeroed,
    mask_language.window_without_block_offset,
    mask_language.chunked_local_chunk_ids,
    mask_language.dilation_offset_reset_per_rank,
    mask_language.prefix_off_by_one,
    mask_language.nan_on_empty_row,
    mask_language.idle_rank_output_uninitialised,
    scale.tile_tail_dropped,
    scale.positions_in_input_dtype,
    scale.head_dim_dispatch_slip,
    calls.no_grad_path_causal_by_rank,
    calls.q_scaled_in_place,
    calls.inputs_assumed_contiguous,
    calls.dout_assumed_contiguous,
    calls.qk_product_in_input_dtype,
    by_feature.steps_rounded_to_power_of_two,
    by_feature.uneven_split_crash_from_three,
    by_feature.last_rank_own_block_unmasked,
    collective_comm.all_gather_read_before_wait,
    collective_comm.all_to_all_input_reuse,
    variants.sink_every_step,
    variants.sink_forward_only,
    variants.softcap_unscaled,
    variants.softcap_grad_dropped,
    variants.alibi_local_positions,
    variants.value_buffers_sized_by_head_dim,
    serving.decode_lse_log2_merged,
    serving.decode_lse_returned_log2,
    serving.decode_causal_bound_from_local_length,
    serving.decode_empty_share_nan,
    serving.decode_multi_token_causal_offset,
    serving.decode_pages_by_global_length,
    serving.decode_context_chunk_local_length,
]

MUTANTS: dict[str, Callable[..., Any]] = {fn.__name__.replace("_", "-"): fn for fn in _ALL}

__all__ = ["MUTANTS"]
