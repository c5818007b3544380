"""A held send (send-reuse) keeps the order of the ops posted after it.

NCCL runs one peer's ops in the order they are posted. Posting a receive before the send it
follows deadlocked two ranks on one GPU (docs/gpu.md, issue #45). No process group is needed: the
interposer is given fake transports that record the order.
"""

from __future__ import annotations

import torch

from harness.faults.interpose import Interposer
from harness.faults.schema import FaultSpec


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        return True


def _interposer(faults):
    ip = Interposer(0, faults, timeout_s=5.0)
    ip.set_phase("forward")
    return ip


def _post(log, what):
    def post(t):
        log.append((what, t.clone()))
        return _Done()

    return post


def test_a_receive_after_a_held_send_is_posted_after_it():
    log: list = []
    ip = _interposer([FaultSpec(0, "send-reuse", op="send", count=100)])
    send, recv = torch.ones(3), torch.zeros(3)
    ip.post_send("isend", send, 1, _post(log, "send"))
    ip.post_recv("irecv", recv, 1, _post(log, "recv"))
    assert log == []  # both held: the rank has not blocked yet
    send.fill_(7.0)  # the ring reuses its buffer too early: the transport reads it late
    ip.flush()
    assert [w for w, _ in log] == ["send", "recv"]
    assert log[0][1].tolist() == [7.0] * 3


def test_without_a_held_send_a_receive_is_posted_at_once():
    log: list = []
    ip = _interposer([])
    ip.post_recv("irecv", torch.zeros(3), 1, _post(log, "recv"))
    ip.post_send("isend", torch.ones(3), 1, _post(log, "send"))
    assert [w for w, _ in log] == ["recv", "send"]
