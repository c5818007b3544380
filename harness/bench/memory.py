"""Figure 3: peak memory of one rank of the reference ring at a fixed total length, W = 1, 2, 4, 8,
and at long lengths (8k, 16k, 32k tokens at W = 4: the per-rank peak must grow linearly in tokens,
the tiled kernel's O(n/W x d + tile^2), not as the untiled block's (n/W)^2).

Every W runs in fresh rank processes (so no allocator state carries over) with glibc told to give
large freed blocks back to the OS (MALLOC_MMAP_THRESHOLD_), so RSS follows live memory. Each rank
builds only its own shard from the seed and warms up with one full call (lazy imports, gloo pairs,
the allocator's one-time growth, ~7 MiB at 8k tokens; the long rows warm up at their shortest
length), then measures its peak RSS above that baseline during forward and during forward +
backward: the kernel's high-water mark (VmHWM, reset before each phase) or, where it cannot be
reset, a 1 ms sampler. `retained` is what forward leaves alive for backward (saved tensors and the
output).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness.bench.timing import Figure, Target, fmt

WORLDS = (1, 2, 4, 8)
MIB = 1 << 20


def _rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    """This process's resident high-water mark (VmHWM) in bytes. Unlike ru_maxrss it is not
    inherited from the parent across fork + exec, and clear_refs can reset it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Peak:
    """Highest RSS during the `with` block: the kernel's high-water mark, reset on entry (exact),
    and a 1 ms /proc/self/statm sampler (the fallback where the mark cannot be reset)."""

    def __init__(self) -> None:
        self.seen = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.seen = max(self.seen, _rss())
            time.sleep(0.001)

    def __enter__(self) -> Peak:
        self.exact = _reset_hwm()
        self.seen = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.seen, _rss(), _hwm() if self.exact else 0)


def _rank_main(rank: int, world_size: int, workdir: str, spec: dict) -> dict:
    """One rank: shard from the seed, warm-up, then peaks of forward and forward + backward."""
    import gc

    import torch
    import torch.distributed as dist

    from harness import inputs
    from harness.case import make_case
    from ring_impl import ring_attention
    from ring_impl.layouts import all_positions

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(workdir, "store"), world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    case = make_case(
        world_size=world_size,
        total_len=spec["total"],
        layout=spec["layout"],
        mask=spec["mask"],
        heads_q=spec["heads"],
        heads_kv=spec["heads"],
        head_dim=spec["dim"],
        dtype=spec["dtype"],
    )

    def call(c):
        pos = all_positions(c.layout, c.seq_lens)[rank]
        q, k, v, dout = (inputs.make(c, n, pos) for n in inputs.NAMES)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        kw = {"layout": c.layout, "lengths": c.seq_lens, "mask": c.mask}
        return q, k, v, dout, kw

    warm = case
    if spec.get("warmup_total"):
        warm = make_case(
            world_size=world_size,
            total_len=spec["warmup_total"],
            layout=spec["layout"],
            mask=spec["mask"],
            heads_q=spec["heads"],
            heads_kv=spec["heads"],
            head_dim=spec["dim"],
            dtype=spec["dtype"],
        )
    q, k, v, dout, kw = call(warm)
    # warm-up: lazy imports, allocator growth
    torch.autograd.backward(ring_attention(q, k, v, **kw), dout)
    del q, k, v, dout
    q, k, v, dout, kw = call(case)
    gc.collect()
    dist.barrier()
    base = _rss()
    with Peak() as fwd:
        out = ring_attention(q, k, v, **kw)
    retained = _rss() - base
    with Peak() as bwd:
        torch.autograd.backward(out, dout)
    dist.barrier()
    dist.destroy_process_group()
    shard = sum(t.numel() * t.element_size() for t in (q, k, v))
    from ring_impl.kernel import tile_for, tile_scores

    tile = tile_for(q.shape[0] * q.shape[2], tile_scores())
    return {
        "rank": rank,
        "tokens": int(q.shape[1]),
        "tile": tile,
        "base": base,
        "forward": fwd.peak - base,
        "forward_backward": max(fwd.peak, bwd.peak) - base,
        "retained": retained,
        "shard_qkv": shard,
    }


def measure(world_size: int, spec: dict, timeout_s: float = 600.0) -> list[dict]:
    """Run one W in fresh processes; every rank's figures (bytes above its baseline)."""
    workdir = tempfile.mkdtemp(prefix="ring-bench-mem-")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_=str(1 << 16),
        MALLOC_TRIM_THRESHOLD_="0",
    )
    if spec.get("tile_scores"):
        env["RING_TILE_SCORES"] = str(spec["tile_scores"])
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = []
    try:
        for r in range(world_size):
            cmd = [
                sys.executable,
                "-m",
                "harness.bench.memory",
                "--rank",
                str(r),
                "--world",
                str(world_size),
                "--dir",
                workdir,
                "--spec",
                json.dumps(spec),
                "--parent",
                str(os.getpid()),
            ]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            )
        end = time.monotonic() + timeout_s
        errs = []
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
            if p.returncode:
                errs.append(err.decode(errors="replace")[-600:])
        if errs:
            raise RuntimeError(f"memory rank failed: {errs[0]}")
        return [json.loads(Path(workdir, f"mem-{r}.json").read_text()) for r in range(world_size)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)


LONG_TOTALS = (8192, 16384, 32768)
LONG_WORLD = 4


def run(quick: bool = False) -> Figure:
    """Measure the figure; `quick` uses short sequences, W = 1, 2 and a tiny tile budget (smoke
    test)."""
    worlds = (1, 2) if quick else WORLDS
    spec = _spec(quick)
    rows = {w: measure(w, spec) for w in worlds}
    fig = Figure(
        "memory",
        "reference ring, one rank's peak memory above its baseline at "
        f"L={spec['total']} "
        f"(h{spec['heads']} d{spec['dim']} {spec['dtype']} {spec['layout']} "
        "causal), "
        f"and at long lengths (W={LONG_WORLD})",
    )
    _world_rows(fig, rows)
    totals = tuple(t // 16 for t in LONG_TOTALS) if quick else LONG_TOTALS
    long_spec = dict(spec, warmup_total=min(totals))
    long = {n: measure(LONG_WORLD, dict(long_spec, total=n), timeout_s=1800.0) for n in totals}
    ratios = _long_rows(fig, long)
    fig.targets = [
        Target(
            f"fwd+bwd peak per rank, {n} / {n // 2} tokens (linear: 2, quadratic: 4)", r, "<=", 2.3
        )
        for n, r in ratios
    ]
    masked = _mask_rows(fig, long_spec, min(totals), long[min(totals)])
    fig.data = {
        "spec": spec,
        "ranks": {str(w): rs for w, rs in rows.items()},
        "long": {str(n): rs for n, rs in long.items()},
        "masks": masked,
    }
    return fig


def _spec(quick: bool) -> dict:
    """The case every W runs: causal zigzag, fp32; `quick` is short, with tiles of 64 tokens."""
    spec = {
        "total": 512 if quick else 4096,
        "heads": 4,
        "dim": 64,
        "dtype": "fp32",
        "layout": "zigzag",
        "mask": {"kind": "causal"},
    }
    if quick:
        # tiles of 64 tokens, so the smoke test runs the tiled kernel
        spec["tile_scores"] = 4 * 64 * 64
    return spec


def _world_rows(fig: Figure, rows: dict[int, list[dict]]) -> None:
    """The table of one rank's peaks against W on `fig`, each against W = 1's, and its legend."""
    one = {k: max(r[k] for r in rows[1]) for k in ("forward", "forward_backward", "retained")}
    fig.lines.append(
        f"{'W':>2}  {'forward MiB':>12} {'x W / W1':>8}  {'fwd+bwd MiB':>12} "
        f"{'x W / W1':>8}  "
        f"{'retained MiB':>12} {'x W / W1':>8}  {'q+k+v shard MiB':>15}  {'tile':>5}  "
        f"{'fwd+bwd B/token':>15}"
    )
    for w, rs in rows.items():
        top = {
            k: max(r[k] for r in rs)
            for k in ("forward", "forward_backward", "retained", "shard_qkv", "tokens")
        }
        rel = {k: w * top[k] / one[k] if one[k] > 0 else float("nan") for k in one}
        fig.lines.append(
            f"{w:>2}  {fmt(top['forward'] / MIB):>12} {fmt(rel['forward']):>8}  "
            f"{fmt(top['forward_backward'] / MIB):>12} "
            f"{fmt(rel['forward_backward']):>8}  "
            f"{fmt(top['retained'] / MIB):>12} {fmt(rel['retained']):>8}  "
            f"{fmt(top['shard_qkv'] / MIB):>15}  {rs[0]['tile']:>5}  "
            f"{fmt(top['forward_backward'] / max(1, top['tokens'])):>15}"
        )
    fig.lines.append(
        "per rank: the largest over the ranks of that W; 'x W / W1' = W * figure(W) / "
        "figure(1); a block "
        "larger than one tile (heads x tile^2 score entries, the device's budget) is "
        "computed in tiles, "
        "so the peak is O(n/W x d + tile^2): B/token = peak / local tokens"
    )


def _long_rows(fig: Figure, long: dict[int, list[dict]]) -> list[tuple[int, float]]:
    """The long rows' table on `fig`: peaks against L at W = LONG_WORLD, each against L/2's.

    Returns (L, peak(L) / peak(L/2)) of every L but the first.
    """
    fig.lines.append(
        f"long: {'L':>6}  {'tokens/rank':>11}  {'fwd MiB':>8}  {'fwd+bwd MiB':>11}  "
        f"{'x prev':>6}  "
        f"{'retained MiB':>12}  {'fwd+bwd B/token':>15}"
    )
    ratios, prev = [], None
    for n, rs in long.items():
        top = {
            k: max(r[k] for r in rs) for k in ("forward", "forward_backward", "retained", "tokens")
        }
        ratio = top["forward_backward"] / prev if prev else float("nan")
        if prev:
            ratios.append((n, ratio))
        prev = top["forward_backward"]
        fig.lines.append(
            f"      {n:>6}  {top['tokens']:>11}  {fmt(top['forward'] / MIB):>8}  "
            f"{fmt(top['forward_backward'] / MIB):>11}  {fmt(ratio):>6}  "
            f"{fmt(top['retained'] / MIB):>12}  "
            f"{fmt(top['forward_backward'] / top['tokens']):>15}"
        )
    fig.lines.append(
        "long: each L in fresh ranks after a warm-up at the shortest L; 'x prev' = "
        "peak(L) / peak(L/2): "
        "2 is linear in tokens, 4 would be the untiled kernel's (n/W)^2"
    )
    peaks = [max(r["forward_backward"] for r in rs) for rs in long.values()]
    steps = [b - a for a, b in zip(peaks, peaks[1:], strict=False)]
    if len(steps) >= 2 and steps[0] > 0:
        fig.lines.append(
            "long: below 2 where the constant tile workspace dominates; the growth "
            "per doubling, "
            + ", ".join(f"{fmt(d / MIB)} MiB" for d in steps)
            + f", itself doubles (x{fmt(steps[-1] / steps[-2])}): linear in tokens"
        )
    return ratios


def mask_specs(total: int) -> dict[str, dict]:
    """The mask language's shapes at `total` tokens (issue #16): Llama 4 chunked attention,
    prefix-LM, a bidirectional window, LongNet dilation (most rows see nothing) and packed documents
    without a prefix."""
    c = max(2, total // 8)
    return {
        "causal&chunked": {"and": [{"kind": "causal"}, {"kind": "chunked", "size": c + 1}]},
        "causal|prefix": {"or": [{"kind": "causal"}, {"kind": "prefix", "length": c}]},
        "window(L,R)": {"kind": "window", "left": c, "right": c // 2},
        "dilated": {"kind": "dilated", "segment": 2 * c, "rate": 4, "offset": 1},
        "doc&!prefix": {
            "and": [
                {"kind": "document", "starts": [0, total // 3, total // 2 + 1]},
                {"not": {"kind": "prefix", "length": 3}},
            ]
        },
    }


def _mask_rows(fig: Figure, long_spec: dict, total: int, causal: list[dict]) -> dict:
    """The same long case under each of `mask_specs`, in fresh ranks: its per-rank peak against
    causal's. The per-block decision and the tiles' masks are evaluated a slab or a tile at a time,
    so no mask may raise the peak above the causal one by more than the mask's own tile-sized
    temporaries."""
    base = max(r["forward_backward"] for r in causal)
    fig.lines.append(
        f"masks: L={total} W={LONG_WORLD}  {'mask':<16} {'fwd+bwd MiB':>11}  "
        f"{'x causal':>8}  "
        f"{'fwd+bwd B/token':>15}"
    )
    out = {}
    for name, mask in mask_specs(total).items():
        rs = measure(LONG_WORLD, dict(long_spec, total=total, mask=mask), timeout_s=1800.0)
        top = {k: max(r[k] for r in rs) for k in ("forward_backward", "tokens")}
        ratio = top["forward_backward"] / base if base > 0 else float("nan")
        fig.lines.append(
            f"       {'':<{len(str(total)) + len(str(LONG_WORLD)) + 6}} {name:<16} "
            f"{fmt(top['forward_backward'] / MIB):>11}  {fmt(ratio):>8}  "
            f"{fmt(top['forward_backward'] / top['tokens']):>15}"
        )
        fig.targets.append(
            Target(
                f"fwd+bwd peak per rank under {name} / causal at {total} tokens", ratio, "<=", 1.25
            )
        )
        out[name] = rs
    fig.lines.append(
        "masks: each in fresh ranks at the long rows' shortest L; x causal = "
        "peak(mask) / peak(causal)"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="harness.bench.memory")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", dest="world_size", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--parent", type=int, required=True)
    a = p.parse_args(argv)
    from harness.ranks.worker import _die_with_parent

    _die_with_parent(a.parent)
    res = _rank_main(a.rank, a.world_size, a.dir, json.loads(a.spec))
    Path(a.dir, f"mem-{a.rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
