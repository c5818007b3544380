"""Everything that runs in a rank process or talks to one.

Process model
-------------
The parent (the process that judges: a command, the pytest plugin, a bench) starts the ranks and
talks to them; each rank is a separate process that runs cases and sends back shards.

In the parent:
    pool.py       RankPool: starts worker processes, sends cases, watches deadlines, reads stacks
    launch.py     open_pool: a RankPool, or a TorchrunPool on torchrun's rank 0
    leftovers.py  which of a pool's processes outlived it (process hygiene, checked after a run)
    protocol.py   the Pool interface, the messages and tickets (imported on both sides)

In each rank (``python -m harness.ranks.worker``, or every torchrun process):
    worker.py     the serve loop and its handlers; runs one case and builds the reply
    wire.py       pickling of messages (tensors as raw bytes)
    backend.py    gloo or nccl, and the device
    torchrun.py   the torchrun driver (its rank 0 also plays the parent)
    reference.py  the rank's share of the oracle: float64 reference + base for its own query rows
                  (issue #12; computed after the run, outside the fault interposer; judged in the parent)
    plus what a case needs: harness/faults/ (the interposer and fault mechanism), harness/impls/
    (the registry resolves the implementation: adapters, capabilities), harness/inputs.py,
    harness/case.py, harness/context.py, ring_impl/, and the leaf modules they import (errors).

What a rank may import: only the modules above and their imports. Never ``harness.judging``,
``harness.search``, ``harness.checks``, ``harness.diagnose``, ``harness.commands`` or hypothesis:
they are the parent's (slow to import, and a rank must not judge its own results: it computes its oracle share,
the parent assembles and judges).
"""
