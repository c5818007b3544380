"""CPU numerics of the flash-attn stand-in: flash-attention 2's forward and backward, in torch, on
CPU.

Layout (b, s, h, d) as flash-attn's padded API; every sequence of a batch has the same (seqlen_q,
seqlen_k) here (the varlen entry points call this once per document). Rounding points follow
flash-attn 2's kernels (csrc/flash_attn/src/flash_fwd_kernel.h, flash_bwd_kernel.h at tag v2.8.3):

forward   S = scale * q @ k^T in fp32 (inputs upcast); keys in blocks of KEY_BLOCK with a running
          row max m and sum l (fp32); P = exp(S - m) in fp32, l += rowsum(P) in fp32, P rounded to
          the input dtype before P @ V (fp32 accumulation); out = acc / l cast to the input dtype;
          lse = m + log(l) (fp32). A row that sees no key: out = 0, lse = +inf (softmax.h: `sum == 0
          ? INFINITY`).
backward  D = rowsum(dout * out) in fp32 from the GIVEN out; P = exp(S - lse) from the GIVEN lse
          (fp32, 0 where masked); dV = round(P)^T @ dO; dP = dO @ V^T (fp32); dS = P * (dP - D)
          (fp32), rounded to the input dtype before dQ = dS @ K * scale and dK = dS^T @ Q * scale
          (fp32 accumulation). GQA/MQA: query head i uses kv head i // (Hq // Hkv); per-query-head
          dK/dV are rounded to the input dtype (flash_api.cpp's dk_expanded) and then summed over
          the group (at::sum_out, fp32 accumulation).

Memory is O(seqlen_q * KEY_BLOCK) per head for the scores, never O(seqlen_q * seqlen_k).
"""

from __future__ import annotations

import torch

KEY_BLOCK = 128

Window = tuple[int, int] | None


def normalise_window(causal: bool, left: int, right: int, seqlen_k: int) -> Window:
    """flash-attn 2.8.3's window arithmetic: (left, right) both >= 0, or None for no window at all.

    mha_fwd / mha_varlen_fwd (flash_api.cpp): a side >= seqlen_k becomes -1; causal sets right = 0.
    set_params_fprop: left < 0 with right >= 0 gives left = seqlen_k; left >= 0 with right < 0 gives
    right = seqlen_k (NOT infinity: with seqlen_q > seqlen_k + 1 the first rows then see fewer keys,
    or none). `seqlen_k` is max_seqlen_k in the varlen API. (mha_fwd's `seqlen_q == 1 -> not causal`
    changes nothing: with one query row bottom-right causal already sees every key.)
    """
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    if left < 0:
        left = seqlen_k
    if right < 0:
        right = seqlen_k
    return left, right


def visible(
    seqlen_q: int,
    seqlen_k: int,
    start: int,
    stop: int,
    window: Window,
    device: torch.device | None = None,
) -> torch.Tensor:
    """(seqlen_q, stop - start) bool: query i sees key j (start <= j < stop), bottom-right aligned.

    mask.h apply_mask_local: masked iff j >= i + 1 + sk - sq + right or j < i + sk - sq - left.
    """
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(start, stop, device=device).unsqueeze(0)
    if window is None:
        return (cols < seqlen_k).expand(seqlen_q, stop - start)
    left, right = window
    diag = rows + (seqlen_k - seqlen_q)
    return (cols >= diag - left) & (cols <= diag + right) & (cols < seqlen_k)


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """(b, s, h, d) any dtype -> (b, h * group, s, d) float32, kv head h repeated for its `group`
    query heads."""
    x = x.float().permute(0, 2, 1, 3)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: Window,
    block: int = KEY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (b, sq, hq, d) in q.dtype and lse (b, hq, sq) float32 for q (b, sq, hq, d), k/v (b, sk,
    hkv, d)."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    dtype = q.dtype
    qf = _heads_first(q, 1)
    kf = _heads_first(k, group)
    vf = _heads_first(v, group)
    neg_inf = float("-inf")
    row_max = torch.full((batch, heads_q, seqlen_q), neg_inf, device=q.device)
    row_sum = torch.zeros(batch, heads_q, seqlen_q, device=q.device)
    acc = torch.zeros(batch, heads_q, seqlen_q, v.shape[-1], device=q.device)
    for start in range(0, seqlen_k, block):
        stop = min(seqlen_k, start + block)
        vis = visible(seqlen_q, seqlen_k, start, stop, window, q.device)
        if not bool(vis.any()):
            continue  # flash-attn skips key blocks outside the window (n_block_min / n_block_max)
        s = torch.matmul(qf, kf[:, :, start:stop].transpose(-1, -2)) * scale
        s = s.masked_fill(~vis, neg_inf)
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        # softmax.h's guard
        safe_max = torch.where(new_max == neg_inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max.unsqueeze(-1))
        alpha = torch.exp(row_max - safe_max)
        row_sum = row_sum * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(p.to(dtype).float(), vf[:, :, start:stop])
        row_max = new_max
    empty = row_sum == 0
    out = acc / torch.where(empty, torch.ones_like(row_sum), row_sum).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(row_sum, float("inf")), row_max + torch.log(row_sum))
    return out.to(dtype).permute(0, 2, 1, 3), lse


def _sum_groups(x: torch.Tensor, heads_k: int, dtype: torch.dtype) -> torch.Tensor:
    """(b, hq, s, d) fp32 per query head -> (b, s, hkv, d) in dtype, rounding per head first when
    grouped."""
    batch, heads_q, seqlen, dim = x.shape
    if heads_q != heads_k:
        x = x.to(dtype).float().view(batch, heads_k, heads_q // heads_k, seqlen, dim).sum(dim=2)
    return x.to(dtype).permute(0, 2, 1, 3)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    window: Window,
    block: int = KEY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (b, sq, hq, d), dk/dv (b, sk, hkv, d) in q.dtype and D = rowsum(dout * out) (b, hq, sq)
    float32.

    P comes from the given lse and D from the given out, as flash-attn's backward does: ring
    attention passes the merged (global) out and lse, and each block's gradient is then its share of
    the global one.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    dtype = q.dtype
    qf = _heads_first(q, 1)
    kf = _heads_first(k, group)
    vf = _heads_first(v, group)
    dof = _heads_first(dout, 1)
    delta = (dof * _heads_first(out, 1)).sum(dim=-1)  # flash_bwd_preprocess: dot(dO, O) in fp32
    lse_f = lse.float().unsqueeze(-1)
    dq = torch.zeros_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for start in range(0, seqlen_k, block):
        stop = min(seqlen_k, start + block)
        vis = visible(seqlen_q, seqlen_k, start, stop, window, q.device)
        if not bool(vis.any()):
            continue
        k_blk, v_blk = kf[:, :, start:stop], vf[:, :, start:stop]
        s = torch.matmul(qf, k_blk.transpose(-1, -2)) * scale
        p = torch.where(vis, torch.exp(s - lse_f), torch.zeros_like(s))
        dv[:, :, start:stop] = torch.matmul(p.to(dtype).float().transpose(-1, -2), dof)
        dp = torch.matmul(dof, v_blk.transpose(-1, -2))
        ds = (p * (dp - delta.unsqueeze(-1))).to(dtype).float()
        dq += torch.matmul(ds, k_blk)
        dk[:, :, start:stop] = torch.matmul(ds.transpose(-1, -2), qf)
    dq_out = (dq * scale).to(dtype).permute(0, 2, 1, 3)
    return dq_out, _sum_groups(dk * scale, heads_k, dtype), _sum_groups(dv, heads_k, dtype), delta
