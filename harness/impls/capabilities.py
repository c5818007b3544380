"""Which features a case uses, whether an implementation declares them, and the capability matrix
(feature x declared / passed / failed, plus what an undeclared feature really does when probed)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.case import Case
from harness.context import Capabilities


def case_features(c: Case) -> list[str]:
    """The features a case exercises, as `kind:value` strings."""
    feats = [f"layout:{c.layout}", f"mask:{c.mask.kind}", f"dtype:{c.dtype}", f"world:{c.world_size}"]
    if c.heads_q != c.heads_kv:
        feats.append("gqa" if c.heads_kv > 1 else "mqa")
    if len(set(c.seq_lens)) > 1:
        feats.append("uneven")
    if c.group_offset:
        feats.append("subgroup")
    return feats


def unsupported(caps: Capabilities, c: Case) -> list[str]:
    """Features of the case that the implementation does not declare (empty: fully supported)."""
    missing = []
    if c.layout not in caps.layouts:
        missing.append(f"layout:{c.layout}")
    if c.mask.kind not in caps.masks:
        missing.append(f"mask:{c.mask.kind}")
    if c.dtype not in caps.dtypes:
        missing.append(f"dtype:{c.dtype}")
    lo, hi = caps.world_sizes
    if not lo <= c.world_size <= hi:
        missing.append(f"world:{c.world_size}")
    if c.heads_q != c.heads_kv and not caps.gqa:
        missing.append("gqa" if c.heads_kv > 1 else "mqa")
    if len(set(c.seq_lens)) > 1 and not caps.uneven:
        missing.append("uneven")
    if caps.head_dims is not None and c.head_dim not in caps.head_dims:
        missing.append(f"head_dim:{c.head_dim}")
    if c.group_offset and not caps.subgroups:
        missing.append("subgroup")
    return missing


def adapt(caps: Capabilities, c: Case) -> Case | None:
    """The nearest supported variant of a case when only its split or head_dim is undeclared (so an
    implementation without uneven splits still gets every mask/layout/dtype); None if none exists."""
    from ring_impl.layouts import split_lengths

    missing = set(unsupported(caps, c))
    if not missing or not missing <= {"uneven"} | {m for m in missing if m.startswith("head_dim:")}:
        return None
    if "uneven" in missing:
        unit = 2 * c.world_size
        total = max(unit, (c.total_len + unit - 1) // unit * unit)
        c = c.replace(seq_lens=tuple(split_lengths(total, c.world_size)))
    if caps.head_dims is not None and c.head_dim not in caps.head_dims:
        c = c.replace(head_dim=min(caps.head_dims, key=lambda d: abs(d - c.head_dim)))
    return c if not unsupported(caps, c) else None


PROBE_OUTCOMES = {
    "fail-stop": "rejected with an error (right)",
    "pass": "works although undeclared",
    "silent-corruption": "FINDING: accepted and returned wrong numbers",
    "diverged": "FINDING: accepted and returned wrong shapes",
    "hang": "FINDING: hangs",
}


@dataclass
class MatrixRow:
    feature: str
    declared: bool
    passed: int = 0
    failed: int = 0
    probes: dict[str, int] = field(default_factory=dict)  # verdict -> count, for undeclared probes


def matrix(caps: Capabilities, results: list, probe_results: list) -> list[MatrixRow]:
    """Aggregate case results by feature; probe results are cases using undeclared features."""
    rows: dict[str, MatrixRow] = {}
    probed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in results:
        for f in case_features(r.case):
            row = rows.setdefault(f, MatrixRow(f, True))
            if r.passed:
                row.passed += 1
            else:
                row.failed += 1
    for r in probe_results:
        for f in unsupported(caps, r.case):
            rows.setdefault(f, MatrixRow(f, False))
            probed[f][r.verdict] += 1
    for f, counts in probed.items():
        rows[f].probes = dict(counts)
    return [rows[k] for k in sorted(rows, key=lambda k: (k.split(":")[0], k))]


def format_matrix(rows: list[MatrixRow]) -> list[str]:
    lines = [f"{'feature':<20} {'declared':<9} {'passed':>6} {'failed':>6}  probe of an undeclared feature"]
    for row in rows:
        probe = ", ".join(f"{n} x {PROBE_OUTCOMES.get(v, v)}" for v, n in sorted(row.probes.items()))
        lines.append(f"{row.feature:<20} {'yes' if row.declared else 'no':<9} {row.passed:>6} {row.failed:>6}  "
                     f"{probe or '-'}")
    return lines
