"""The tolerance rule, in one place: a bound for the family of correct implementations, not for ours.

Per tensor t (out, lse, dq, dk, dv) and rank:

    max|impl - ref64| <= k_t * max|base - ref64|
                         + u(dtype) * sum_c n_tc * T_tc
                         + (W + max|lse|) * eps32 * max(max_c T_tc, max|ref64|)

`ref64`: single-device attention in float64 on the same dtype-rounded inputs; `base`: the same plain
attention in the case's dtype (k = 2 for out/lse, 3 for gradients: flash-attention's rule), the error of
implementations that do their arithmetic like plain attention; u(dtype) = eps/2, the unit roundoff (one
rounding to nearest errs by at most u, relative). T_tc: the scale of the *terms* t is summed from, never
of t itself (oracle.TermScales, float64, every T_tc >= max|ref64_t|), so the bound cannot collapse when
the result is ~0 (2 tokens, near-tie values: dq = scale sum_j dS_ij k_j with sum_j dS_ij = 0).

The flash-style family (derivation; docs/tolerance.md has it with the evidence): inputs are exact in
the dtype, every product and sum is accumulated in fp32, and these are rounded to the input dtype, each
at most once per element and ring (R1-R6): R1 P before P @ V and before dV = P^T dO; R2 each block's
partial result (flash-attn returns a block's out, dq, dk, dv in the dtype and rings merge them in fp32);
R3 the final cast; R4 dS before dQ = dS K and dK = dS^T Q; R5 D = rowsum(dO * O) from the dtype-rounded
O, and D itself; R6 per-query-head dK/dV before the GQA group sum (flash-attn's dk_expanded). With
p the probabilities, dP_ij = dO_i . v_j, D_i = dO_i . O_i, dS_ij = p_ij (dP_ij - D_i), sigma the scale,
A_i = sum_j p_ij sum_d |dO_id| |v_jd| (|D_i|, |dP| on average, and every rounding of O seen through D):

- out_id = sum_j p_ij v_jd. R1 errs by u sum_j p_ij |v_jd|; R2 (a p-weighted mean of block outputs, each
  rounded at its own scale) and R3 by as much: n = 3 at T = max_id sum_j p_ij |v_jd|.
- D (enters dq and dk): R1 (through O), R2, R3, R5 each err by <= u A_i: 4 u A_i.
- dq_i: D's error enters as sigma sum_j p_ij dD_i k_j <= 4 u sigma max|k| A_i: n = 4 at
  T_D = sigma max|k| max_i A_i; R4, R2 (sum over blocks of |block dq| <= sum_j |dS_ij| |k_j|), R3 each
  u sigma max|k| sum_j |dS_ij|: n = 3 at T_terms = sigma max|k| max_i sum_j |dS_ij|.
- dk_j = sigma sum_i dS_ij q_i (over the group's query heads): n = 4 at sigma max|q| max_j sum_i p_ij A_i
  (D) and n = 4 (R4, R2, R3, R6) at sigma max|q| max_j sum_i |dS_ij|.
- dv_j = sum_i p_ij dO_i: R1, R2, R3, R6: n = 4 at max|dO| max_j sum_i p_ij.
- lse: a float32 output (the Impl contract), never rounded to the input dtype: judged at float32 (n = 2
  at sigma max|q| max|k|, no `base`), plus, for fp16/bf16 inputs, the absolute error of a reduced-precision
  exp: P = exp(s - m)(1 + r) gives |d lse| <= r, whatever |lse|. PyTorch's CPU flash kernel (torch-ring)
  reaches r ~ 6.4e-5 at every length >= 16 (1.4e-4 with large logits in fp16, covered by the float32
  term there); LSE_EXP_ERROR = 2^-13 = 1.2e-4 covers it, 10x below the low-precision-accumulator
  mutant's smallest lse error on the battery (1.3e-3, its out/lse merged in the input dtype).
- the float32 term: one float32 unit per ring step (W partial results merged in fp32) and max|lse| units
  (P = exp(s - lse) recomputed from the merged lse, whose rounding eps32 |lse| is a relative error of
  every P), at the largest term scale.

Not in the family: rounding a *running* result (the out/lse accumulator, dq, travelling dk/dv) once per
ring step; its error grows with W. No single-W bound separates that from R2 at W <= 4, so the growth check
(harness/checks/growth.py) judges it. A case may override k per tensor (`tolerance:`). NaN/Inf fail.
Evidence: docs/tolerance.md (the issue's false alarms now pass, calibration runs, mutant kills).
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
# A ring merges W partial outputs in float32 as ring-flash-attn and torch's ring do: out - w (out - block_out).
# Both subtractions round at the magnitude of the partial outputs, at most max|v| (the "blocks" scale), however
# small the merged out: two float32 roundings per merge, W - 1 merges (docs/tolerance.md, "The merge's rounding")
MERGE_ROUNDINGS = 2


def factor(tensor: str, overrides: dict | None = None) -> float:
    """k for a tensor, unless the case overrides it."""
    if overrides and tensor in overrides:
        return float(overrides[tensor])
    return K_FACTORS[tensor]


def unit(dtype: str) -> float:
    """The unit roundoff u = eps / 2 of a dtype: one rounding to nearest errs by at most u relative."""
    return EPS[dtype] / 2


def bound(tensor: str, dtype: str, base_error: float, ref_absmax: float, overrides: dict | None = None,
          world_size: int = 1, lse_absmax: float = 0.0, term_scale: float | Mapping[str, float] = 0.0,
          block_scale: float = 0.0) -> float:
    """The largest allowed max-abs error for `tensor` on a ring of `world_size` ranks:

        k * base_error + u(dtype) * sum_c n_c * T_c + (W + max|lse|) * eps32 * max(max_c T_c, ref_absmax)
        (+ for out: (W - 1) * eps32 * block_scale, the merges' cancellation: MERGE_ROUNDINGS)

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
    if tensor == "out":
        floor += MERGE_ROUNDINGS * max(world_size - 1, 0) * unit("fp32") * block_scale
    return factor(tensor, overrides) * base_error + floor
