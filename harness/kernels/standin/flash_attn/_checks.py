"""The argument checks of the flash-attn stand-in: flash-attn 2.8.3's TORCH_CHECKs, same texts.

The texts match csrc/flash_attn/flash_api.cpp at tag v2.8.3, so a ring library sees the errors it
would see on a GPU. What the CPU cannot reproduce raises NotImplementedError instead.
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def check_floats(op: str, **values: object) -> None:
    """The custom op schema's type check (torch.library): a float argument may not be None."""
    for name, value in values.items():
        if value is None:
            raise RuntimeError(
                f"flash_attn::{op}() Expected a value of type 'float' for argument '{name}' "
                "but instead found type 'NoneType'."
            )


def check(cond: bool, message: str) -> None:
    """TORCH_CHECK: a RuntimeError with flash-attn's own text when `cond` fails."""
    if not cond:
        raise RuntimeError(message)


def check_shape(x: torch.Tensor, name: str, shape: tuple[int, ...], names: str) -> None:
    check(tuple(x.shape) == shape, f"{name} must have shape ({names})")


def check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")


def check_forward_dims(batch: int, head_size: int, num_heads: int, num_heads_k: int) -> None:
    check(batch > 0, "batch size must be positive")
    check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(
        head_size % 8 == 0,
        "query, key, value, and out_ must have a head_size that is a multiple of 8",
    )
    check(
        num_heads % num_heads_k == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def check_backward_dims(batch: int, head_size: int, num_heads: int, num_heads_k: int) -> None:
    check(batch > 0, "batch size must be positive")
    check(head_size % 8 == 0, "head_size should be a multiple of 8")
    check(head_size <= 256, "FlashAttention backward only supports head dimension at most 256")
    check(
        num_heads % num_heads_k == 0,
        "Number of heads in key/value must divide number of heads in query",
    )


def refuse_unsupported(dropout_p: float, softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    """Dropout, softcapping and ALiBi: flash-attn's own refusal first, then the stand-in's."""
    if softcap > 0.0:
        check(dropout_p == 0.0, "Softcapping does not support dropout for now")
    if dropout_p > 0.0:
        raise NotImplementedError(
            "flash-attn CPU stand-in: dropout_p > 0 is not supported (flash-attn draws its dropout "
            "mask "
            "from its CUDA Philox generator, which the stand-in cannot reproduce)"
        )
    if softcap > 0.0:
        raise NotImplementedError("flash-attn CPU stand-in: softcap > 0 is not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn CPU stand-in: alibi_slopes is not supported")


def check_grad_buffer(
    buf: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple, names: str
) -> None:
    """A dq, dk or dv buffer the caller passed: its dtype, last-dimension stride and shape."""
    if buf is None:
        return
    check(buf.dtype == dtype, f"{name} must have the same dtype as q")
    check(buf.stride(-1) == 1, f"{name} must have contiguous last dimension")
    check_shape(buf, name, shape, names)
