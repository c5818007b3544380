"""P2P staging (harness.faults.staging), on CPU tensors: what --device cuda does to every P2P op,
forced with --stage-p2p so CI runs the same code. Guards: NCCL's per-peer FIFO matching (tags
ignored), one Work per batch_isend_irecv, the receive buffer written only at wait, and the forced
path through the default check's battery and fault stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.checks.check import check
from harness.checks.options import CheckOptions
from harness.checks.report import ListReporter
from harness.faults import staging
from harness.ranks.backend import Placement
from harness.ranks.pool import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(tmp_path, stage: bool) -> dict:
    store = tmp_path / f"store-{stage}"
    cmd = [sys.executable, "-m", "tests.helpers.staging_probe", "--store", str(store)] + (
        ["--stage"] if stage else []
    )
    procs = [
        subprocess.Popen(
            cmd + ["--rank", str(r)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return json.loads(outs[1].strip().splitlines()[-1])


def test_staged_p2p_matches_as_nccl_does_and_writes_the_receive_buffer_at_wait(tmp_path):
    plain, staged = _probe(tmp_path, False), _probe(tmp_path, True)
    # gloo matches by tag: the tag-2 receive gets the tag-2 message; NCCL (and staging) ignore tags:
    # FIFO
    assert plain["tag2_receive_got"] == 2.0
    assert staged["tag2_receive_got"] == 1.0
    # NCCL's batch_isend_irecv gives one Work for the batch; gloo one per op
    assert (plain["batch_works"], staged["batch_works"]) == (2, 1)
    assert plain["batch_got"] == staged["batch_got"] == 0.0
    # gloo writes a CPU receive buffer when the data arrives; a staged receive lands at the wait
    assert plain["before_wait"] == 7.0 and staged["before_wait"] == -1.0
    assert plain["after_wait"] == staged["after_wait"] == 7.0


def test_the_host_kernel_runs_a_functional_collective_on_host_copies(tmp_path):
    """The CUDA kernel --device cuda gives funcol's all-gather (docs/gpu.md: SIGSEGV on gloo
    otherwise), run here on CPU tensors in a one-rank gloo group: same result as the op itself,
    waited."""
    import torch.distributed as dist

    code = (
        "import torch, torch.distributed as dist\n"
        "from harness.faults.staging import through_host, stage_functional_collectives\n"
        f"dist.init_process_group('gloo', store=dist.FileStore({str(tmp_path / 'fc')!r}, 1), "
        "rank=0, world_size=1)\n"
        "op = torch.ops._c10d_functional.all_gather_into_tensor.default\n"
        "x = torch.arange(6.0).view(2, 3)\n"
        "name = dist.group.WORLD.group_name\n"
        "got = through_host(op, torch.device('cpu'))(x, 1, name)\n"
        "assert torch.equal(got, x), got\n"
        "out = torch.empty_like(x)\n"
        "through_host(op, torch.device('cpu'))(x, 1, name, out=out)\n"
        "assert torch.equal(out, x), out\n"
        "assert stage_functional_collectives(torch.device('cpu')) == ()\n"
        "dist.destroy_process_group()\n"
        "print('host kernel ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "host kernel ok" in r.stdout, r.stdout + r.stderr
    assert dist.is_available()


def test_host_buffers_are_pinned_only_for_gpu_tensors():
    t = torch.ones(2, 3).t()  # not contiguous
    h = staging.host_buffer(t)
    assert h.shape == t.shape and h.device.type == "cpu" and not h.is_pinned()


def test_placement_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RING_HARNESS_DEVICE", "cpu")
    monkeypatch.setenv("RING_HARNESS_STAGE_P2P", "1")
    assert Placement.from_env() == Placement("cpu", True) and Placement.from_env().staged
    assert not Placement().staged and Placement("cuda").staged
    with pytest.raises(ValueError):
        Placement("tpu")


@pytest.mark.slow
def test_forced_staging_passes_the_battery_and_the_fault_stage(tmp_path):
    """The reference ring through staged P2P on gloo ranks: every battery case and every early-read
    / send-reuse case of the fault stage (the ones whose meaning staging must keep) pass. ~15 s,
    slow tier (#55): the staging's semantics stay in the default suite (the test above)."""
    res = check(
        CheckOptions(
            stage_p2p=True,
            world_size=4,
            max_examples=0,
            growth=False,
            scale=False,
            repeat=False,
            save_dir=str(tmp_path),
        ),
        reporter=ListReporter(),
    )
    assert res.passed, res.failures
    assert len(res.fault_results) >= 9 and all(r.passed for r in res.fault_results)


def test_a_pool_passes_its_placement_to_its_ranks():
    with RankPool(2, placement=Placement("cpu", True)) as pool:
        pool.ensure(2)
        # the worker's arguments (a forked worker's command line is its zygote's)
        cmd = list(pool.procs[0].args)
    assert "--stage-p2p" in cmd and cmd[cmd.index("--device") + 1] == "cpu"
