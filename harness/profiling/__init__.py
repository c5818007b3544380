"""`ring-harness profile`: does a ring keep ring attention's promises, beyond the right numbers?

It runs one call per case with every rank instrumented (harness.ranks.instrument) and reads three
deterministic verdicts off what came back: the memory class (`memory.py`), the bytes and messages
against the ring's minimum (`traffic.py`) and whether compute hides the transfers (`overlap.py`).
`measure.py` runs the calls; `report.py` plans them and prints one table for several rings.
On CUDA ranks `devicetime.py` reports each ring step's exposed communication from CUDA events.
docs/promises.md says what is judged and what is only reported.
"""
