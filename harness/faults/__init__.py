"""Fault injection: fault specs in the Case (schema), the torch.distributed interposer that logs every
op and injects faults inside each rank (interpose, inject), fault-aware verdicts (verdicts), a
hypothesis strategy (strategies), and the fault battery behind `ring-harness check --faults`
(battery, command)."""
