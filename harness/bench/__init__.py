"""Benchmarks of the harness and the reference ring (`ring-harness bench`): one module per figure,
each a `run(quick) -> Figure` whose targets are ratios measured side by side in one run."""

FIGURES = {
    "pool_vs_spawn": "harness.bench.pool_vs_spawn",
    "overhead": "harness.bench.overhead",
    "memory": "harness.bench.memory",
    "speed": "harness.bench.speed",
    "oracle_growth": "harness.bench.oracle_growth",
    "oracle_split": "harness.bench.oracle_split",
    "check_cost": "harness.bench.check_cost",
    "report": "harness.bench.report",
    "case_cost": "harness.bench.case_cost",
}
