"""What each fault kind does to a collective, in one process with fake transports: c10d's (async
and blocking) and the functional ones (harness.faults.collectives, functional), the schema that
selects them, and the refusal of process groups made inside run (harness.faults.pg_guard)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness.errors import CommError, ImplError
from harness.faults import functional, pg_guard
from harness.faults.interpose import Interposer
from harness.faults.schema import FaultSpec, make_fault, parse_fault

GROUP = object()  # a stand-in process group of global ranks 0, 1


class _Late:
    """A fake Work whose transport moves the data when it is waited."""

    def __init__(self, move) -> None:
        self.move, self.done = move, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.move()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _ip(*faults: dict, timeout_s: float = 5.0) -> Interposer:
    ip = Interposer(0, [parse_fault(i, f, 2) for i, f in enumerate(faults)], timeout_s=timeout_s)
    ip.peers_of[id(GROUP)] = (0, 1)
    ip.set_phase("forward")
    return ip


def _gather(ip: Interposer, out, inp, async_op=True):
    """all_gather_into_tensor over two ranks that hold the same data; the transport reads `inp`
    when waited, so a read of the posted input shows a late change."""
    sent = []

    def post(output_tensor, input_tensor, group, async_op):
        sent.append(input_tensor)
        return _Late(lambda: output_tensor.copy_(input_tensor.repeat(2)))

    ip.orig["all_gather_into_tensor"] = post
    args = {"output_tensor": out, "input_tensor": inp, "group": GROUP, "async_op": async_op}
    return ip.collective("all_gather_into_tensor", args), sent


def _swap(ip: Interposer, out, inp):
    def post(output, input, output_split_sizes, input_split_sizes, group, async_op):
        return _Late(lambda: output.copy_(input.flip(0)))

    ip.orig["all_to_all_single"] = post
    args = dict(
        output=out,
        input=inp,
        output_split_sizes=None,
        input_split_sizes=None,
        group=GROUP,
        async_op=True,
    )
    return ip.collective("all_to_all_single", args)


def test_a_fault_selects_collectives_by_direction_or_family():
    spec = parse_fault(0, {"kind": "early-read", "op": "all_gather"}, 2)
    assert spec.applies_to("forward", "collective", "all_gather_into_tensor")
    assert not spec.applies_to("forward", "collective", "all_to_all_single")
    reuse = parse_fault(0, make_fault("send-reuse", op="any"), 2)
    assert reuse.applies_to("forward", "send") and reuse.applies_to("backward", "collective")
    assert not reuse.applies_to("forward", "recv")
    assert not reuse.applies_to("forward", "collective", "all_reduce", inputs=False)  # in place
    drop = parse_fault(0, {"kind": "drop", "rank": 1, "op": "all_to_all"}, 2)
    assert drop.describe() == "drop rank 1 any all_to_all #0"


def test_early_read_poisons_an_async_collectives_output_until_its_wait():
    ip = _ip(make_fault("early-read"))
    out = torch.zeros(4)
    fw, _ = _gather(ip, out, torch.tensor([1.0, 2.0]))
    assert torch.isnan(out).all()
    fw.wait()
    assert out.tolist() == [1.0, 2.0, 1.0, 2.0] and ip.schedule.fired[0] == 1


def test_a_blocking_collective_gives_early_read_nothing_to_act_on():
    ip = _ip(make_fault("early-read"))
    out = torch.zeros(4)
    assert _gather(ip, out, torch.tensor([1.0, 2.0]), async_op=False)[0] is None
    assert out.tolist() == [1.0, 2.0, 1.0, 2.0] and ip.schedule.fired[0] == 0


def test_send_reuse_watches_a_collectives_input_until_its_wait():
    ip = _ip(make_fault("send-reuse", op="collective"))
    inp, out = torch.tensor([1.0, 2.0]), torch.zeros(2)
    fw = _swap(ip, out, inp)
    inp.fill_(9.0)  # reused before the op completed
    fw.wait()
    assert out.tolist() == [2.0, 1.0]  # the op read the input as posted: replayable numbers
    (v,) = ip.violations
    assert v == (
        "rank 0: all_to_all_single with peer ranks 0, 1 (forward, op #0): input buffer modified "
        "before the op completed (the transport may read it late)"
    )
    fine = _ip(make_fault("send-reuse", op="collective"))
    inp = torch.tensor([1.0, 2.0])
    _swap(fine, torch.zeros(2), inp).wait()
    inp.fill_(9.0)  # after the wait: allowed
    fine.set_phase("done")
    assert fine.violations == [] and fine.schedule.fired[0] == 1


def test_drop_never_posts_and_fails_at_the_limit_naming_op_peers_and_phase():
    ip = _ip(make_fault("drop", rank=0, op="collective"), timeout_s=0.2)
    ip.orig["all_gather_into_tensor"] = lambda **kw: pytest.fail("a dropped op was posted")
    args = {"output_tensor": torch.zeros(4), "input_tensor": torch.ones(2), "group": GROUP}
    t0 = time.monotonic()
    with pytest.raises(CommError) as e:
        ip.collective("all_gather_into_tensor", dict(args, async_op=False))
    assert 0.15 < time.monotonic() - t0 < 2.0
    assert str(e.value).startswith(
        "rank 0: all_gather_into_tensor with peer ranks 0, 1 (forward, op #0) timed out after"
    )
    assert ip.schedule.fired[0] == 1 and ip.ops[0].state == "failed"


def test_corrupt_flips_a_collectives_output_and_delay_holds_its_wait():
    ip = _ip(
        make_fault("corrupt", rank=0, op="collective", bit=30),
        make_fault("delay", op="all_gather", seconds=0.1, where="complete"),
    )
    out = torch.zeros(4)
    fw, _ = _gather(ip, out, torch.tensor([1.0, 2.0]))
    t0 = time.monotonic()
    fw.wait()
    assert time.monotonic() - t0 >= 0.1
    assert sum(a != b for a, b in zip(out.tolist(), [1.0, 2.0, 1.0, 2.0], strict=True)) == 1
    assert dict(ip.schedule.fired) == {0: 1, 1: 1}


# -- functional collectives ------------------------------------------------------------------------


def _gather_op(x, group_size, group_name):
    return torch.cat([x * 1.0] * group_size)


def test_functional_early_read_reads_nan_until_wait_tensor_and_keeps_the_gradient():
    ip = _ip(make_fault("early-read"))
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    out = functional.run(ip, "all_gather_into_tensor", _gather_op, lambda t: t, (x, 2, "g"), {})
    assert torch.isnan(out).all() and ip.pending
    waited = functional.wait_tensor(ip, lambda t: t, out)
    assert waited.tolist() == [1.0, 2.0, 1.0, 2.0] and not ip.pending
    (waited * torch.arange(4.0)).sum().backward()
    assert x.grad.tolist() == [2.0, 4.0]  # the gradient reaches the input through the stand-in


def test_functional_send_reuse_watches_the_input_until_wait_tensor():
    ip = _ip(make_fault("send-reuse", op="collective"))
    x = torch.tensor([1.0, 2.0])
    out = functional.run(ip, "all_gather_into_tensor", _gather_op, lambda t: t, (x, 2, "g"), {})
    x.mul_(3.0)
    functional.wait_tensor(ip, lambda t: t, out)
    assert out.tolist() == [1.0, 2.0, 1.0, 2.0] and len(ip.violations) == 1
    assert "input buffer modified before the op completed" in ip.violations[0]


def test_functional_drop_hands_back_nan_of_the_ops_shape_and_fails_at_the_limit():
    ip = _ip(make_fault("drop", rank=0, op="all_gather"), timeout_s=0.2)

    def shape_only(x, group_size, group_name):  # called with meta tensors only
        return x.new_empty((group_size * x.shape[0], *x.shape[1:]))

    args = (torch.ones(2, 3), 4, "g")
    out = functional.run(ip, "all_gather_into_tensor", shape_only, None, args, {})
    assert out.shape == (8, 3) and torch.isnan(out).all()
    with pytest.raises(CommError, match=r"all_gather_into_tensor \(forward, op #0\) timed out"):
        functional.wait_tensor(ip, lambda t: t, out)


def test_hooked_replaces_the_functional_ops_for_one_case():
    ns = torch.ops._c10d_functional
    before = ns.all_to_all_single
    ip = _ip()
    with functional.hooked(ip):
        hook = ns.all_to_all_single
        assert hook is not before and hook.default is before.default  # attributes pass through
        assert ns.wait_tensor(torch.ones(1)).tolist() == [1.0]  # an unknown tensor waits as usual
    assert ns.all_to_all_single is before


# -- process groups made inside run ----------------------------------------------------------------


def _fake_new_group(seen: list):
    def new_group(ranks=None, timeout=None, backend=None, use_local_synchronization=False):
        seen.append(c10d._hash_ranks_to_str(ranks or []))
        return "group"

    return new_group


def test_a_group_made_inside_run_is_refused_before_the_call(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    calls: list = []
    monkeypatch.setattr(c10d, "new_group", _fake_new_group(calls))
    monkeypatch.setattr(dist, "new_group", c10d.new_group)
    with pg_guard.guarded(ring=(0, 1)):
        with pytest.raises(ImplError) as e:
            dist.new_group(ranks=[0, 1])
        with pytest.raises(ImplError, match=r"torch.distributed.new_subgroups\(\) makes"):
            dist.new_subgroups()
        with pytest.raises(ImplError, match=r"DeviceMesh\(...\) makes a process group"):
            DeviceMesh._init_process_groups(None, None, None, None)
        with pytest.raises(ImplError):  # a local group of ranks outside the ring
            dist.new_group(ranks=[0, 2], use_local_synchronization=True)
    msg = str(e.value)
    assert msg.startswith("torch.distributed.new_group(ranks=[0, 1]) makes a process group inside")
    assert "ctx.group" in msg and "use_local_synchronization=True" in msg and "\n" not in msg
    assert calls == [] and dist.new_group is c10d.new_group


def test_a_local_group_of_ring_ranks_goes_through_under_a_name_its_members_agree_on(monkeypatch):
    names: list = []
    monkeypatch.setattr(c10d, "new_group", _fake_new_group(names))
    with pg_guard.guarded(ring=(0, 1, 2), case_id=7):
        assert c10d.new_group(ranks=[1, 2], use_local_synchronization=True) == "group"
        c10d.new_group(ranks=[1, 2], use_local_synchronization=True)
    assert names[0] != names[1] and c10d._hash_ranks_to_str is pg_guard._HASH
    again: list = []
    monkeypatch.setattr(c10d, "new_group", _fake_new_group(again))
    with pg_guard.guarded(ring=(0, 1, 2), case_id=7):  # another rank, same case: the same name
        c10d.new_group(ranks=[1, 2], use_local_synchronization=True)
    assert again == names[:1]


def test_schema_still_reads_p2p_faults_as_before():
    assert FaultSpec(0, "send-reuse", op="send").applies_to("forward", "send")
    assert not FaultSpec(0, "send-reuse", op="send").applies_to("forward", "collective")


def test_the_battery_and_the_strategies_draw_faults_that_select_collectives():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from harness.faults.schema import KINDS
    from harness.search.fault_battery import fault_cases
    from harness.search.fault_strategies import fault

    for c in fault_cases(KINDS, 14, collective=True):
        (f,) = c.faults
        assert f["kind"] == "straggler" or f["op"] == "collective", f
        if f["kind"] in ("drop", "corrupt", "crash"):  # the first collective of the forward
            assert (f["phase"], f["index"]) == ("forward", 0), f

    @settings(max_examples=30, deadline=None)
    @given(st.sampled_from(KINDS).flatmap(lambda k: fault(k, 3, collective=True)))
    def drawn(f):
        assert make_fault(**f) == f and (f["kind"] == "straggler" or f["op"] == "collective")

    drawn()


def test_polling_a_dropped_collective_fails_at_the_limit_too():
    ip = _ip(make_fault("drop", rank=0, op="collective"), timeout_s=0.1)
    ip.orig["all_gather_into_tensor"] = lambda **kw: pytest.fail("a dropped op was posted")
    args = {"output_tensor": torch.zeros(4), "input_tensor": torch.ones(2), "group": GROUP}
    fw = ip.collective("all_gather_into_tensor", dict(args, async_op=True))
    with pytest.raises(CommError, match="a fault dropped it on this rank"):
        fw.is_completed()  # a ring that polls rather than waits ends too, never spins
