"""The CPU stand-in's API against flash-attn 2.8.3's: the texts of its refusals, and the names,
order and defaults of its functions' parameters. Its numerics: test_flash_standin.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.flash_float64 import backward, fa, fai, forward, inputs


def test_refusals_use_flash_attn_texts():
    q, k, v, dout = inputs(torch.float16, 1, 8, 8, 2, 2, 16)
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16 data type$"):
        forward(q.float(), k.float(), v.float())
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16 data type$"):
        fa.flash_attn_func(q.float(), k.float(), v.float())
    big = inputs(torch.float16, 1, 8, 8, 2, 2, 260)
    with pytest.raises(
        RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"
    ):
        forward(*big[:3])
    with pytest.raises(
        RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"
    ):
        fa.flash_attn_func(*big[:3])  # padded to 264 first, as flash-attn does
    with pytest.raises(RuntimeError, match="^head_size should be a multiple of 8$"):
        backward(big[3], *big[:3], big[3], torch.zeros(1, 2, 8))
    odd = inputs(torch.float16, 1, 8, 8, 2, 2, 12)
    with pytest.raises(
        RuntimeError, match="^query, key, value, and out_ must have a head_size that is a multiple"
    ):
        forward(*odd[:3])
    with pytest.raises(NotImplementedError, match="dropout_p > 0 is not supported .*Philox"):
        fai._flash_attn_forward(q, k, v, 0.1, 0.25, False, -1, -1, 0.0, None, False)
    with pytest.raises(NotImplementedError, match="dropout_p > 0"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="softcap"):
        fa.flash_attn_func(q, k, v, softcap=30.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.zeros(2))
    with pytest.raises(
        RuntimeError, match="^Number of heads in key/value must divide number of heads in query$"
    ):
        forward(
            q,
            k[:, :, :1].expand(1, 8, 3, 16).contiguous(),
            v[:, :, :1].expand(1, 8, 3, 16).contiguous(),
        )
    with pytest.raises(
        RuntimeError, match="^return_softmax is only supported when p_dropout > 0.0$"
    ):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, 0.0, None, True)
    with pytest.raises(
        RuntimeError, match="Expected a value of type 'float' for argument 'softcap'"
    ):
        fai._flash_attn_forward(q, k, v, 0.0, 0.25, False, -1, -1, None, None, False)
    with pytest.raises(RuntimeError, match="^cu_seqlens_q must have dtype int32$"):
        cu = torch.tensor([0, 8], dtype=torch.int64)
        fai._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, 0.0, 0.25, False)
    out, lse, _, _ = forward(q, k, v)
    with pytest.raises(RuntimeError, match="^dq must have the same dtype as q$"):
        backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            bufs=(torch.empty(q.shape), torch.empty_like(k), torch.empty_like(v)),
        )


# the parameters of flash-attn 2.8.3's private forwards and backwards, after their own leading ones
COMMON = [
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "alibi_slopes",
]


def _forward_signatures() -> dict:
    """The private forwards: parameter names in order, and the defaults."""
    return {
        "_flash_attn_forward": (["q", "k", "v", *COMMON, "return_softmax"], ()),
        "_flash_attn_varlen_forward": (
            [
                "q",
                "k",
                "v",
                "cu_seqlens_q",
                "cu_seqlens_k",
                "max_seqlen_q",
                "max_seqlen_k",
                *COMMON,
                "return_softmax",
                "block_table",
                "leftpad_k",
                "seqused_k",
                "zero_tensors",
            ],
            (-1, -1, 0.0, None, False, None, None, None, False),
        ),
    }


def _backward_signatures() -> dict:
    """The private backwards: parameter names in order, and the defaults."""
    grads = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv"]
    return {
        "_flash_attn_backward": ([*grads, *COMMON, "deterministic", "rng_state"], (None,)),
        "_flash_attn_varlen_backward": (
            [
                *grads,
                "cu_seqlens_q",
                "cu_seqlens_k",
                "max_seqlen_q",
                "max_seqlen_k",
                *COMMON,
                "deterministic",
                "rng_state",
                "zero_tensors",
            ],
            (None, False),
        ),
    }


def test_signatures_match_flash_attn_2_8_3():
    """Parameter names, order and defaults copied from flash-attn v2.8.3's
    flash_attn_interface.py."""
    import inspect

    expected = {**_forward_signatures(), **_backward_signatures()}
    for name, (args, defaults) in expected.items():
        spec = inspect.getfullargspec(getattr(fai, name))
        assert (
            inspect.isfunction(getattr(fai, name))
            and spec.args == args
            and (spec.defaults or ()) == defaults
        )
    spec = inspect.getfullargspec(fa.flash_attn_func)
    assert spec.args == [
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "alibi_slopes",
        "deterministic",
        "return_attn_probs",
    ]
    assert spec.defaults == (0.0, None, False, (-1, -1), 0.0, None, False, False)
    assert (
        fa.__version__ == "2.8.3"
        and fa.__ring_harness_standin__ is True
        and not fa.__version__ < "2.6.3"
    )
