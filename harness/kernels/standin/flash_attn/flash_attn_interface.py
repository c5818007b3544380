"""CPU stand-in for `flash_attn.flash_attn_interface` (flash-attn 2.8.3), the part ring libraries
call.

Signatures match flash-attn tag v2.8.3 (commit 060c9188beec3a8b62b33a3bfa6d5d2d44975fab),
flash_attn/flash_attn_interface.py; checks and error texts (in `_checks`) match
csrc/flash_attn/flash_api.cpp at that tag. In 2.8.3 the four private functions are
`torch.library.custom_op`s (CustomOpDef, whose `_init_fn` is the Python function ring-flash-attn's
`get_default_args` inspects); here they are plain functions with the same parameter names, order
and defaults, so `inspect.getfullargspec` gives callers the same answer.

Who imports what (read from the released wheels):
- ring-flash-attn 0.1.8: `flash_attn.flash_attn_interface._flash_attn_forward/_flash_attn_backward`
  (ring_flash_attn.py, zigzag_ring_flash_attn.py, stripe_flash_attn.py) and
  `_flash_attn_varlen_forward/_flash_attn_varlen_backward` (ring_flash_attn_varlen.py,
  zigzag_ring_flash_attn_varlen.py, llama3_flash_attn_varlen.py). It calls them with keyword
  arguments built from the argspec (window_size_left/right because `window_size` is absent;
  softcap=0.0).
- yunchang 0.6.4: `import flash_attn` (reads `flash_attn.__version__`, compared as a string with
  '2.6.3'), `flash_attn.flash_attn_interface._flash_attn_forward/_flash_attn_backward` (globals.py,
  kernels/attention.py), `from flash_attn import flash_attn_func` (kernels/__init__.py) and
  `_flash_attn_varlen_forward/_flash_attn_varlen_backward` (ring/ring_flash_attn_varlen.py,
  ring/zigzag_ring_flash_attn_varlen.py; those two call them with flash-attn < 2.6 arguments).
Nothing imports flash_attn.bert_padding, flash_attn.ops, flash_attn_varlen_func or the packed
variants.

Refused (flash-attn's own texts, RuntimeError like TORCH_CHECK): dtypes other than fp16/bf16,
head_dim > 256 or not a multiple of 8 (the private functions; flash_attn_func pads to a multiple of
8 as 2.8.3 does), head counts that do not divide. Not reproducible on CPU (NotImplementedError):
dropout_p > 0 (flash-attn's mask comes from its CUDA Philox generator), softcap > 0, alibi_slopes,
paged KV (block_table), leftpad_k, seqused_k.
"""

from __future__ import annotations

import torch

from . import _checks, _cpu_core


def round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (b, sq, h, d), softmax_lse (b, h, sq) float32, S_dmask (empty), rng_state (2,) int64."""
    _checks.check_floats(
        "_flash_attn_forward", dropout_p=dropout_p, softmax_scale=softmax_scale, softcap=softcap
    )
    batch, seqlen_q, num_heads, head_size = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    _checks.check_dtypes(q, k, v)
    _checks.check_forward_dims(batch, head_size, num_heads, num_heads_k)
    _checks.refuse_unsupported(dropout_p, softcap, alibi_slopes)
    names = "batch_size, seqlen_k, num_heads_k, head_size"
    _checks.check_shape(k, "k", (batch, seqlen_k, num_heads_k, head_size), names)
    _checks.check_shape(v, "v", (batch, seqlen_k, num_heads_k, head_size), names)
    _checks.check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    window = _cpu_core.normalise_window(
        bool(causal), int(window_size_left), int(window_size_right), seqlen_k
    )
    out, lse = _cpu_core.forward(q, k, v, float(softmax_scale), window)
    return out, lse, *_no_softmax_no_rng(q)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """out (total_q, h, d), softmax_lse (h, total_q) float32, S_dmask (empty), rng_state (2,) int64.

    Each document b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against
    k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]], causal/window bottom-right aligned per document; window
    sides are clamped against max_seqlen_k. Rows of q outside every document (flash-attn leaves them
    unwritten): out 0, lse +inf (-inf with zero_tensors).
    """
    _checks.check_floats(
        "_flash_attn_varlen_forward",
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        softcap=softcap,
    )
    total_q, num_heads, head_size = q.shape
    _checks.check_dtypes(q, k, v)
    _checks.check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _checks.check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise NotImplementedError(
            "flash-attn CPU stand-in: block_table, leftpad_k and seqused_k are not supported"
        )
    batch = cu_seqlens_q.numel() - 1
    total_k, num_heads_k = k.shape[0], k.shape[1]
    _checks.check_forward_dims(batch, head_size, num_heads, num_heads_k)
    _checks.refuse_unsupported(dropout_p, softcap, alibi_slopes)
    _checks.check_shape(
        k, "k", (total_k, num_heads_k, head_size), "total_k, num_heads_k, head_size"
    )
    _checks.check_shape(
        v, "v", (total_k, num_heads_k, head_size), "total_k, num_heads_k, head_size"
    )
    _checks.check_shape(cu_seqlens_q, "cu_seqlens_q", (batch + 1,), "batch_size + 1")
    _checks.check_shape(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), "batch_size + 1")
    _checks.check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    window = _cpu_core.normalise_window(
        bool(causal), int(window_size_left), int(window_size_right), max_seqlen_k
    )
    out = torch.zeros_like(q)
    lse = torch.full(
        (num_heads, total_q), float("-inf") if zero_tensors else float("inf"), device=q.device
    )
    for qs, k_slice in _documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
        doc_out, doc_lse = _cpu_core.forward(
            q[qs].unsqueeze(0),
            k[k_slice].unsqueeze(0),
            v[k_slice].unsqueeze(0),
            float(softmax_scale),
            window,
        )
        out[qs] = doc_out[0]
        lse[:, qs] = doc_lse[0]
    return out, lse, *_no_softmax_no_rng(q)


def _no_softmax_no_rng(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """S_dmask (empty without dropout) and rng_state (2,) int64 (meaningless without dropout)."""
    return torch.empty((0,), dtype=q.dtype, device=q.device), torch.zeros(
        (2,), dtype=torch.int64, device=q.device
    )


def _documents(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_seqlen_q: int
) -> list[tuple[slice, slice]]:
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    docs = []
    for b in range(len(bounds_q) - 1):
        seqlen_q = bounds_q[b + 1] - bounds_q[b]
        if seqlen_q > max_seqlen_q:
            # flash-attn launches ceil(max_seqlen_q / kBlockM) row blocks: the rest of the rows stay
            # unwritten
            raise RuntimeError(
                f"flash-attn CPU stand-in: document {b} has seqlen_q {seqlen_q} > max_seqlen_q "
                f"{max_seqlen_q}"
            )
        docs.append((slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])))
    return docs


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Writes dq, dk, dv in place (any strides); returns softmax_d (b, h, round_multiple(sq, 128))
    float32."""
    _checks.check_floats(
        "_flash_attn_backward", dropout_p=dropout_p, softmax_scale=softmax_scale, softcap=softcap
    )
    batch, seqlen_q, num_heads, head_size = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    _checks.check_dtypes(q, k, v)
    _checks.check(out.dtype == q.dtype, "query and out must have the same dtype")
    _checks.check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    _checks.check_backward_dims(batch, head_size, num_heads, num_heads_k)
    _checks.refuse_unsupported(dropout_p, softcap, alibi_slopes)
    q_shape, kv_shape = (
        (batch, seqlen_q, num_heads, head_size),
        (batch, seqlen_k, num_heads_k, head_size),
    )
    q_names, kv_names = (
        "batch_size, seqlen_q, num_heads, head_size",
        "batch_size, seqlen_k, num_heads_k, head_size",
    )
    for x, name in ((k, "k"), (v, "v")):
        _checks.check_shape(x, name, kv_shape, kv_names)
    for x, name in ((out, "out"), (dout, "dout")):
        _checks.check_shape(x, name, q_shape, q_names)
    _checks.check_shape(
        softmax_lse, "softmax_lse", (batch, num_heads, seqlen_q), "batch_size, num_heads, seqlen_q"
    )
    _checks.check_grad_buffer(dq, "dq", q.dtype, q_shape, q_names)
    _checks.check_grad_buffer(dk, "dk", q.dtype, kv_shape, kv_names)
    _checks.check_grad_buffer(dv, "dv", q.dtype, kv_shape, kv_names)
    window = _cpu_core.normalise_window(
        bool(causal), int(window_size_left), int(window_size_right), seqlen_k
    )
    gq, gk, gv, delta = _cpu_core.backward(
        dout, q, k, v, out, softmax_lse, float(softmax_scale), window
    )
    for buf, grad in ((dq, gq), (dk, gk), (dv, gv)):
        if buf is not None:
            buf.copy_(grad)
    softmax_d = torch.zeros(
        (batch, num_heads, round_multiple(seqlen_q, 128)), dtype=torch.float32, device=q.device
    )
    softmax_d[:, :, :seqlen_q] = delta
    return softmax_d


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    """Writes dq, dk, dv (document rows only; all of them first zeroed when zero_tensors) in place;
    returns softmax_d (h, total_q + 128 * batch) float32, document b's rows starting at
    cu_seqlens_q[b] + 128 b."""
    _checks.check_floats(
        "_flash_attn_varlen_backward",
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        softcap=softcap,
    )
    total_q, num_heads, head_size = q.shape
    total_k, num_heads_k = k.shape[0], k.shape[1]
    _checks.check_dtypes(q, k, v)
    _checks.check(out.dtype == q.dtype, "query and out must have the same dtype")
    _checks.check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    _checks.check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _checks.check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    batch = cu_seqlens_q.numel() - 1
    _checks.check_backward_dims(batch, head_size, num_heads, num_heads_k)
    _checks.refuse_unsupported(dropout_p, softcap, alibi_slopes)
    q_shape, kv_shape = (total_q, num_heads, head_size), (total_k, num_heads_k, head_size)
    q_names, kv_names = "total_q, num_heads, head_size", "total_k, num_heads_k, head_size"
    for x, name in ((k, "k"), (v, "v")):
        _checks.check_shape(x, name, kv_shape, kv_names)
    for x, name in ((out, "out"), (dout, "dout")):
        _checks.check_shape(x, name, q_shape, q_names)
    _checks.check_shape(softmax_lse, "softmax_lse", (num_heads, total_q), "num_heads, total_q")
    _checks.check_shape(cu_seqlens_q, "cu_seqlens_q", (batch + 1,), "batch_size + 1")
    _checks.check_shape(cu_seqlens_k, "cu_seqlens_k", (batch + 1,), "batch_size + 1")
    _checks.check_grad_buffer(dq, "dq", q.dtype, q_shape, q_names)
    _checks.check_grad_buffer(dk, "dk", q.dtype, kv_shape, kv_names)
    _checks.check_grad_buffer(dv, "dv", q.dtype, kv_shape, kv_names)
    if zero_tensors:
        for buf in (dq, dk, dv):
            if buf is not None:
                buf.zero_()
    window = _cpu_core.normalise_window(
        bool(causal), int(window_size_left), int(window_size_right), max_seqlen_k
    )
    softmax_d = torch.zeros(
        (num_heads, total_q + 128 * batch), dtype=torch.float32, device=q.device
    )
    for b, (qs, ks) in enumerate(_documents(cu_seqlens_q, cu_seqlens_k, max_seqlen_q)):
        one = [x[s].unsqueeze(0) for x, s in ((dout, qs), (q, qs), (k, ks), (v, ks), (out, qs))]
        lse = softmax_lse[:, qs].unsqueeze(0)
        gq, gk, gv, delta = _cpu_core.backward(*one, lse, float(softmax_scale), window)
        for buf, grad, s in ((dq, gq, qs), (dk, gk, ks), (dv, gv, ks)):
            if buf is not None:
                buf[s].copy_(grad[0])
        softmax_d[:, qs.start + 128 * b : qs.stop + 128 * b] = delta[0]
    return softmax_d


class FlashAttnFunc(torch.autograd.Function):
    """2.8.3's FlashAttnFunc over the stand-in's private functions (head dim padded to a multiple of
    8)."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, k, v])
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(3)
        if head_size_og % 8 != 0:
            q = torch.nn.functional.pad(q, [0, 8 - head_size_og % 8])
            k = torch.nn.functional.pad(k, [0, 8 - head_size_og % 8])
            v = torch.nn.functional.pad(v, [0, 8 - head_size_og % 8])
        out_padded, softmax_lse, S_dmask, rng_state = _flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.dropout_p = dropout_p
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        head_size_og = dout.size(3)
        dout_padded = dout
        if head_size_og % 8 != 0:
            dout_padded = torch.nn.functional.pad(dout, [0, 8 - head_size_og % 8])
        _flash_attn_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dq = dq[..., : dout.shape[-1]]
        dk = dk[..., : dout.shape[-1]]
        dv = dv[..., : dout.shape[-1]]
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.8.3's flash_attn_func: q (b, sq, h, d), k/v (b, sk, h_k, d) -> out (b, sq, h, d)
    [, softmax_lse (b, h, sq), S_dmask] with causal/window bottom-right aligned, differentiable."""
    return FlashAttnFunc.apply(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )
