"""The tolerance rule, in one place.

Per tensor and per rank:

    max|impl - ref64| <= k * max|base - ref64|
                         + eps(dtype) * max|ref64| + (W + max|lse|) * eps(fp32) * terms

`ref64` is float64 single-device attention on the same inputs; `base` is the same single-device
attention computed in the case's dtype, so the bound scales with the error that plain attention
of that dtype makes. k = 2 for out and lse, 3 for gradients (flash-attention's rule). The floor
is one unit of rounding of the dtype at the tensor's scale (the final cast), plus the float32
roundings that a blockwise ring makes and single-device autograd does not, at the scale of the
`terms` the result is summed from (oracle.term_scales: e.g. scale*max|dout|*max|v|*max|k| for dq),
not of the result, which can be exactly 0 (dq of a query that sees one key; the property-based run
found such false alarms at allowed ~1e-37):
- one float32 unit per ring step: W partial results are merged in a float32 accumulator, each
  merge rescaling by exp(lse_i - lse);
- max|lse| float32 units: a flash-style backward recomputes P = exp(s - lse) from the merged lse,
  whose absolute rounding eps32 * |lse| becomes a relative error of every P entry (large logits,
  |lse| ~ 100-200, make this the dominant term).
Calibrated on the default battery: without these terms fp32 cases of the correct reference failed at
ratios up to 1.4 (MQA out, W=4) and 1.16 (dk with scores ~100); with them the fp32 floor is still
~1e3 times below a bf16-level error, so low-precision bugs stay visible.
`base` error is measured over the whole tensor (not per rank): a shard of one token gives too few
samples for a stable estimate.

lse is judged at float32 whatever the input dtype: an implementation returns it in float32 (the
Impl contract), and a correct one computes it with float32 accumulation from the dtype-rounded
inputs, so neither the low-precision `base` (whose scores are rounded to fp16/bf16 before the
logsumexp) nor one fp16/bf16 unit of |lse| belongs in its bound: for fp16/bf16 cases the lse bound
is the float32 floor alone. Evidence (ring-harness selftest, default battery, W = 4): with the old
rule the mutant `low-precision-accumulator` (out/lse merged in the input dtype) passed the lse check
on all 8 fp16/bf16 cases (lse errors 1.3e-3 to 0.5, ratios 0.10-0.68), caught only through its
gradients on the one large-logit case; the reference's lse errors there were 2e-7 to 3e-5. Under the
float32 rule the mutant's lse is 6 to 4,300 times over, the reference's at most 0.09 of the bound.
For fp16/bf16 inputs the float32 units of the lse floor are 2^-19 rather than 2^-23: real kernels
for reduced-precision inputs compute exp to ~20 bits (PyTorch's CPU flash attention, behind the
`torch-ring` adapter, uses exp_u20), which gave lse errors of ~1e-5 relative (x7.3 of the 2^-23
bound on `W1 none bf16 d1 L[64] near-tie`) while out stays exact to bf16. 19 bits is still ~2,000
times finer than a bf16 unit, and the low-precision-accumulator mutant stays far over it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LSE_EXP_ERROR = 2.0**-13  # absolute lse error of a ~14-bit exp (torch's CPU flash kernel for fp16/bf16; docstring)
K_FACTORS = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
EPS = {"fp32": torch.finfo(torch.float32).eps, "fp16": torch.finfo(torch.float16).eps,
       "bf16": torch.finfo(torch.bfloat16).eps}
# unit roundoffs (u = eps/2) of the input dtype a correct flash-style ring may commit, per tensor and per
# scale they act at (oracle.TermScales: "terms" = sum of |terms| of the result, "D" = where D's error
# enters); derivation in the module docstring and docs/tolerance.md
ROUNDINGS = {"out": {"terms": 3}, "lse": {"terms": 2}, "dq": {"terms": 3, "D": 4}, "dk": {"terms": 4, "D": 4},
             "dv": {"terms": 4}}


def factor(tensor: str, overrides: dict | None = None) -> float:
    """k for a tensor, unless the case overrides it."""
    if overrides and tensor in overrides:
        return float(overrides[tensor])
    return K_FACTORS[tensor]


def unit(dtype: str) -> float:
    """The unit roundoff u = eps / 2 of a dtype: one rounding to nearest errs by at most u relative."""
    return EPS[dtype] / 2


def bound(tensor: str, dtype: str, base_error: float, ref_absmax: float, overrides: dict | None = None,
          world_size: int = 1, lse_absmax: float = 0.0, term_scale: float | Mapping[str, float] = 0.0) -> float:
    """The largest allowed max-abs error for `tensor` on a ring of `world_size` ranks:

        k * base_error + u(dtype) * sum_c n_c * T_c + (W + max|lse|) * eps32 * max(max_c T_c, ref_absmax)

    with T_c the tensor's term scales (`term_scale`: {class: scale} from oracle.TermScales, or one number
    for every class) and n_c = ROUNDINGS[tensor][c]; every T_c is at least ref_absmax."""
    exp_error = 0.0
    if tensor == "lse" and dtype != "fp32":  # a float32 output: judged at float32 (module docstring)
        dtype, base_error, exp_error = "fp32", 0.0, LSE_EXP_ERROR
    counts = ROUNDINGS[tensor]
    scales = term_scale if isinstance(term_scale, Mapping) else dict.fromkeys(counts, float(term_scale))
    t = {c: max(float(scales.get(c, 0.0)), ref_absmax) for c in counts}
    rounding = unit(dtype) * sum(n * t[c] for c, n in counts.items())
    floor = rounding + (world_size + lse_absmax) * EPS["fp32"] * max(t.values()) + exp_error + 1e-30
    return factor(tensor, overrides) * base_error + floor
