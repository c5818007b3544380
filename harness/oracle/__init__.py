"""The float64 oracle: full attention with the explicit mask, forward and backward.

The ranks compute its shares, and the parent assembles them. Rank-side code imports `shares`. This
package imports nothing of judging, ranks or checks. docs/architecture.md lists its modules, and
docs/oracle.md has the derivation.
"""
