"""The tolerance rule, in one place: a bound for the family of correct implementations.

Per tensor t (out, lse, dq, dk, dv, dsinks) and rank:

    max|impl - exact| <= k_t * max|base - exact|
                         + u(dtype) * sum_c n_tc * T_tc
                         + (S + max|lse|) * eps32 * max(max_c T_tc, max|exact|)

with S the ring's merge steps: W, one more with a sink.

`exact` is the float64 oracle on the dtype-rounded inputs. `base` is plain attention in the case's
dtype; k is 2 for out and lse, 3 for gradients, as in flash-attention's tests. u(dtype) is the unit
roundoff. T_tc is the scale of the terms t is summed from, never of t itself. So the bound cannot
collapse when a result is near zero.

The counts n_tc come from the flash-style family: fp32 accumulation, each result rounded to the
dtype at most once per ring. A running result rounded once per ring step is outside the family. The
growth check judges that. docs/tolerance.md has the derivation, the evidence and the calibration.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# absolute lse error of a ~14-bit exp (torch's CPU flash kernel for fp16/bf16; docs/tolerance.md,
# "lse")
LSE_EXP_ERROR = 2.0**-13
K_FACTORS = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dsinks": 3.0}
EPS = {
    "fp32": torch.finfo(torch.float32).eps,
    "fp16": torch.finfo(torch.float16).eps,
    "bf16": torch.finfo(torch.bfloat16).eps,
}
# unit roundoffs (u = eps/2) of the input dtype a correct flash-style ring may commit, per tensor
# and per scale they act at (harness.oracle.parts.TermScales: "terms" = sum of |terms| of the
# result, "D" = where D's error enters); derivation in docs/tolerance.md
ROUNDINGS = {
    "out": {"terms": 3},
    "lse": {"terms": 2},
    "dq": {"terms": 3, "D": 4},
    "dk": {"terms": 4, "D": 4},
    "dv": {"terms": 4},
    # the sinks' gradient: "terms" = sum_i P_sink,i |D_i|, "D" = sum_i P_sink,i A_i over a share's
    # rows of one head (docs/tolerance.md, "The variants")
    "dsinks": {"terms": 2, "D": 4},
}
# A ring merges W partial outputs in float32 as ring-flash-attn and torch's ring do: out - w (out -
# block_out). Both subtractions round at the magnitude of the partial outputs, at most max|v| (the
# "blocks" scale), however small the merged out: two float32 roundings per merge, W - 1 merges, one
# more with a sink (docs/tolerance.md, "The merge's rounding")
MERGE_ROUNDINGS = 2


def factor(tensor: str, overrides: dict | None = None) -> float:
    """k for a tensor, unless the case overrides it."""
    if overrides and tensor in overrides:
        return float(overrides[tensor])
    return K_FACTORS[tensor]


def unit(dtype: str) -> float:
    """The unit roundoff u = eps / 2 of a dtype: one rounding to nearest errs by at most u
    relative."""
    return EPS[dtype] / 2


def score_units(lse_absmax: float, lse_terms: float, softcap: float | None) -> float:
    """The float32 units of relative error in every P: max|lse|, and with a cap the scores' before
    it. Their error, eps32 T_lse, moves P by as much and softcap's factor c by 2 / cap times that
    (docs/tolerance.md, "The variants")."""
    return lse_absmax + (0.0 if softcap is None else lse_terms * (1 + 2 / softcap))


def bound(
    tensor: str,
    dtype: str,
    base_error: float,
    exact_absmax: float,
    overrides: dict | None = None,
    world_size: int = 1,
    lse_absmax: float = 0.0,
    term_scale: float | Mapping[str, float] = 0.0,
    block_scale: float = 0.0,
    sinks: bool = False,
) -> float:
    """The largest allowed max-abs error for `tensor` on a ring of `world_size` ranks:

        k * base_error + u(dtype) * sum_c n_c * T_c + (S + max|lse|) * eps32 * max(max_c T_c, exact_absmax)
        (+ for out: (S - 1) * eps32 * block_scale, the merges' cancellation: MERGE_ROUNDINGS;
         + for dsinks: the same times T_dout = sum_i P_sink,i |dout_i|_1, that error seen via D)

    with T_c the tensor's term scales (`term_scale`: {class: scale} from
    harness.oracle.parts.TermScales, or one number for every class) and n_c =
    ROUNDINGS[tensor][c]; every T_c is at least exact_absmax. S = W merge steps, W + 1 with
    `sinks`: the sink is one more merge."""
    exp_error = 0.0
    # a float32 output: judged at float32 (docs/tolerance.md)
    if tensor == "lse" and dtype != "fp32":
        dtype, base_error, exp_error = "fp32", 0.0, LSE_EXP_ERROR
    counts = ROUNDINGS[tensor]
    scales = (
        term_scale if isinstance(term_scale, Mapping) else dict.fromkeys(counts, float(term_scale))
    )
    t = {c: max(float(scales.get(c, 0.0)), exact_absmax) for c in counts}
    rounding = unit(dtype) * sum(n * t[c] for c, n in counts.items())
    steps = world_size + int(sinks)
    floor = rounding + (steps + lse_absmax) * EPS["fp32"] * max(t.values()) + exp_error + 1e-30
    if tensor == "out":
        floor += MERGE_ROUNDINGS * max(steps - 1, 0) * unit("fp32") * block_scale
    if tensor == "dsinks":  # those merges' error in out, through D_i = dout_i . out_i
        merged = MERGE_ROUNDINGS * max(steps - 1, 0) * unit("fp32") * block_scale
        floor += merged * float(scales.get("dout", 0.0))
    return factor(tensor, overrides) * base_error + floor
