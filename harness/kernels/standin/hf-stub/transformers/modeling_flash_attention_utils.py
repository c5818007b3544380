"""Stub of `transformers.modeling_flash_attention_utils`: only the name ring-flash-attn 0.1.8
imports."""


def is_flash_attn_greater_or_equal_2_10() -> bool:
    """transformers' helper (a function there too); the stand-in flash-attn is 2.8.3."""
    return True
