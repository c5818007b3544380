"""One of two gloo ranks exercising the interposer's P2P, staged or not; prints what it saw as JSON.

Run as `python -m tests.helpers.staging_probe --rank R --store PATH [--stage]`
(tests/faults/test_staging.py)."""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist

from harness.faults.interpose import Interposer, active


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--stage", action="store_true")
    a = p.parse_args()
    rank, peer = a.rank, 1 - a.rank
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(a.store, 2),
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )
    seen: dict = {}
    with active(Interposer(rank, (), timeout_s=15.0, stage=a.stage)):
        # tags: rank 0 sends 1.0 (tag 1) then 2.0 (tag 2); rank 1 posts its tag-2 receive first
        if rank == 0:
            for w in [
                dist.isend(torch.full((3,), 1.0), 1, tag=1),
                dist.isend(torch.full((3,), 2.0), 1, tag=2),
            ]:
                w.wait()
        else:
            first, second = torch.empty(3), torch.empty(3)
            works = [dist.irecv(first, 0, tag=2), dist.irecv(second, 0, tag=1)]
            for w in works:
                w.wait()
            seen["tag2_receive_got"] = first[0].item()
        # batch_isend_irecv: how many Works, and does waiting the first complete the whole batch
        got = torch.full((2,), -1.0)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer),
                dist.P2POp(dist.irecv, got, peer),
            ]
        )
        seen["batch_works"] = len(works)
        for w in works:
            w.wait()
        seen["batch_got"] = got[0].item()
        # a receive's buffer before and after its wait, once the message has had time to arrive
        buf = torch.full((4,), -1.0)
        if rank == 0:
            dist.isend(torch.full((4,), 7.0), 1).wait()
        else:
            w = dist.irecv(buf, 0)
            time.sleep(0.5)
            seen["before_wait"] = buf[0].item()
            w.wait()
            seen["after_wait"] = buf[0].item()
        dist.barrier()
    print(json.dumps(seen), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
