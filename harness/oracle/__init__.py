"""The float64 oracle: full attention with the explicit mask, forward and backward.

tiles     how a case is cut into tiles of queries x keys
numerics  the arithmetic of one tile: float64 and the same-dtype base side by side
shares    one share's two passes (rows, then keys) and how the parts combine
assemble  the global outputs (`OracleOutputs`: exact and base) from every share's parts
cache     the outputs of the last few cases
mode      who computes the shares (the ranks or this process), deadlines and threads

Rank-side code imports `shares`; this package imports nothing of judging, ranks or checks.
docs/oracle.md has the derivation.
"""
