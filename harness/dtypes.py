"""The dtypes a case may name, defined once: the names, and the maps name <-> torch dtype.

Imports torch only, so any layer (rank-side code included) may import it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "EXACT_INTEGERS", "TORCH_DTYPES", "dtype_name"]

DTYPES: Final[tuple[str, ...]] = ("fp32", "fp16", "bf16")
"""The dtype names a case, a capability declaration or an option may use, in listing order."""

TORCH_DTYPES: Final = MappingProxyType(
    {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
)
"""Dtype name -> torch dtype (read-only)."""

DTYPE_NAMES: Final = MappingProxyType({t: n for n, t in TORCH_DTYPES.items()})
"""torch dtype -> dtype name (read-only); the inverse of TORCH_DTYPES."""


EXACT_INTEGERS: Final = MappingProxyType({"fp32": 1 << 24, "fp16": 2048, "bf16": 256})
"""Dtype name -> the largest n such that the dtype holds every integer 0..n: a position computed in the dtype
rounds beyond it (bf16: 257 -> 256)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The harness name of a torch dtype ('fp32', ...), or `str(dtype)` for one the harness does not
    use."""
    return DTYPE_NAMES.get(dtype, str(dtype))
