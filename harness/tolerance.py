"""The tolerance rule, in one place.

Per tensor and per rank:  max|impl - ref64| <= k * max|base - ref64| + eps(dtype) * max|ref64|

`ref64` is float64 single-device attention on the same inputs; `base` is the same single-device
attention computed in the case's dtype, so the bound scales with the error that plain attention
of that dtype makes. k = 2 for out and lse, 3 for gradients (flash-attention's rule). The floor
is one unit of rounding of the dtype at the tensor's scale: it keeps the bound meaningful when the
base error happens to be ~0. `base` error is measured over the whole tensor (not per rank): a
shard of one token gives too few samples for a stable estimate.
"""

from __future__ import annotations

import torch

K_FACTORS = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
EPS = {"fp32": torch.finfo(torch.float32).eps, "fp16": torch.finfo(torch.float16).eps,
       "bf16": torch.finfo(torch.bfloat16).eps}


def factor(tensor: str, overrides: dict | None = None) -> float:
    """k for a tensor, unless the case overrides it."""
    if overrides and tensor in overrides:
        return float(overrides[tensor])
    return K_FACTORS[tensor]


def bound(tensor: str, dtype: str, base_error: float, ref_absmax: float, overrides: dict | None = None) -> float:
    """The largest allowed max-abs error for `tensor`."""
    return factor(tensor, overrides) * base_error + EPS[dtype] * max(ref_absmax, 1e-30)
