"""The fault mechanism: fault specs carried in the Case (schema), what each fault kind does to a
tensor or a process (inject), and the torch.distributed interposer that logs every op and injects
the faults inside each rank (interpose, built from work, oplog and wrappers; c10d's collectives in
collectives, torch's functional ones in functional; process groups made inside run refused in
pg_guard). All of it runs inside a rank process; the parent uses schema, the op log's readers
(oplog.phase_counts, oplog.comm_steps, oplog.uses_collectives) and pg_guard.REFUSED.

Elsewhere: verdicts under faults in `harness.judging.verdicts`; the hypothesis strategy and the
fault battery's cases in `harness.search`; the battery behind `ring-harness check --faults` in
`harness.checks`.
"""
