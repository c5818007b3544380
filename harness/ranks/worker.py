"""One rank of the persistent pool: receives cases from the parent, runs them, sends back shards.

Started by `harness.ranks.pool` as `python -m harness.ranks.worker`; dies with its parent (PDEATHSIG
plus a watchdog thread), dumps its Python stack on SIGUSR1 (faulthandler) so a hang names where it
waits. Runs inside a rank process: see `harness.ranks` for what it may import. The messages it
answers (`HANDLERS`, one handler per op) are declared in `harness.ranks.protocol`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import faulthandler
import hashlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener

import torch

from harness import calls, inputs
from harness import case as case_mod
from harness.context import RunContext
from harness.errors import ShapeError
from harness.impls.adapters._common import kernel_label
from harness.kernels import flash_standin
from harness.ranks import reference, wire
from harness.ranks.backend import Placement, choose_backend, device_for, rank_device
from harness.ranks.protocol import (
    DIVERGED,
    ERROR,
    IDLE,
    OK,
    ORACLE,
    ORACLE_RESULT,
    PING,
    PONG,
    READY,
    RESULT,
    RUN,
    STOP,
    Message,
    OracleMessage,
    OracleResultMessage,
    PongMessage,
    ReadyMessage,
    ResultMessage,
    RunMessage,
)
from ring_impl.layouts import all_positions


def _die_with_parent(parent: int) -> None:
    """Never outlive the parent: kernel PDEATHSIG where available, plus a polling thread."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes: equal hashes mean bit-identical results."""
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _error_text(e: BaseException) -> str:
    """One line: exception type, message, and the innermost frame it came from."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}{where}"


def _callers_frame(e: BaseException) -> str:
    """'file:line in function' of the innermost frame outside the harness, torch and the standard library: the
    implementation's own call that raised ('' when every frame is the harness's)."""
    import sysconfig

    skip = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__),
            sysconfig.get_paths()["stdlib"])
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        path = os.path.abspath(fr.filename)
        if not path.startswith(skip):
            return f"{os.path.relpath(path) if not os.path.relpath(path).startswith('..') else path}:{fr.lineno} " \
                   f"in {fr.name}"
    return ""


class Groups:
    """Process groups for ring subsets, cached by (offset, size, timeout) and created identically on
    every rank (new_group is collective over the whole pool)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.cache: dict[tuple, object] = {}
        self.retired: list[object] = []  # groups that may hold stale messages: kept, never used again

    def reset(self) -> None:
        """Use fresh groups from now on (after a case whose ranks raised mid-ring); the old ones are
        kept alive rather than destroyed, because destroying a group with ops in flight can block."""
        self.retired.extend(self.cache.values())
        self.cache = {}

    def get(self, offset: int, size: int, timeout_s: float):
        import torch.distributed as dist

        key = (offset, size, round(timeout_s, 3))
        if key not in self.cache:
            group = dist.new_group(
                ranks=list(range(offset, offset + size)),
                timeout=datetime.timedelta(seconds=timeout_s),
                backend=self.backend,
            )
            # every member has finished building the group before any uses it: without this, a member that
            # returned from new_group, raised at once (e.g. refused the case) and closed its pairs
            # (`_close_peers`) could do so while another member was still connecting them, which then
            # waited forever inside new_group (seen: refusal cases hanging at the deadline on gloo)
            if offset <= dist.get_rank() < offset + size:
                dist.barrier(group=group)
            self.cache[key] = group
        return self.cache[key]


def pg_timeout(case: case_mod.Case) -> float:
    """The process-group timeout for a case: well inside its deadline, so ranks fail before the
    parent's watchdog has to step in."""
    return max(1.0, min(case.deadline_s * 0.5, case.deadline_s - 2.0))


def _split(res):
    if isinstance(res, (tuple, list)):
        if len(res) != 2:
            raise ShapeError(f"implementation returned {len(res)} values; expected out or (out, lse)")
        return res[0], res[1]
    return res, None


def _no_phase(phase: str) -> None:
    """Phase marker when no interposer listens."""


def _run_call(impl, q, k, v, dout, ctx, call: str, form: str, phase, times: dict):
    """The forward as `call` makes it, on inputs in `form` (harness.calls); then the backward when the call
    has one. Returns (out, lse, (dq, dk, dv) or None); `times` gets forward_s and backward_s."""

    def fn(q, k, v):
        return _split(impl.run(q, k, v, ctx))

    grad = calls.needs_backward(call)
    mode = torch.inference_mode() if call == "inference-mode" else contextlib.nullcontext()
    with mode:  # a serving model makes its q, k, v under inference_mode too
        x = calls.present(form, q, k, v, dout, grad)
        phase("forward")
        t0 = time.perf_counter()
        out, lse = calls.forward(call, fn, x.q, x.k, x.v)
        times.update(forward_s=time.perf_counter() - t0, backward_s=0.0)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShapeError(f"output shape {got} != expected {tuple(q.shape)}")
    if not grad:
        return out, lse, None
    if not out.requires_grad:
        raise RuntimeError("the output does not require grad: the ring ran no autograd graph (a forward-only "
                           "ring? Capabilities(backward=False))")
    phase("backward")
    t1 = time.perf_counter()
    torch.autograd.backward(out, x.dout)
    times["backward_s"] = time.perf_counter() - t1
    grads = []
    for name, g, t in zip(("q", "k", "v"), x.grads(), (q, k, v), strict=True):
        if g is None:
            raise ShapeError(f"implementation produced no gradient for {name}")
        if tuple(g.shape) != tuple(t.shape):
            raise ShapeError(f"d{name} shape {tuple(g.shape)} != expected {tuple(t.shape)}")
        grads.append(g)
    return out, lse, tuple(grads)


def _forward_backward(impl, q, k, v, dout, ctx, phase=_no_phase, call: str = "train", form: str = "contiguous"):
    """One call of the implementation (harness.calls: train, no-grad, checkpoint, ...) on inputs in `form`.
    Returns (out, lse, grads or None, times); `phase` is told forward / backward / done, so the comm log and
    fault schedule know which."""
    times: dict = {}
    out, lse, grads = _run_call(impl, q, k, v, dout, ctx, call, form, phase, times)
    phase("done")
    return out, lse, grads, times


def run_on_rank(case: case_mod.Case, impl, group, device: torch.device, leak: bool, phase=_no_phase) -> dict:
    """Run one case on this rank: build shards from the seed, forward + backward, leak run (not
    under faults: the fault schedule counts the ops of one forward + backward)."""
    import torch.distributed as dist

    grank = dist.get_rank(group) if group is not None else 0
    world = case.world_size
    gl = tuple(dist.get_global_rank(group, r) for r in range(world)) if group is not None else (0,)
    pos_all = tuple(all_positions(case.layout, case.seq_lens))
    pos = pos_all[grank]
    t_in = time.perf_counter()
    q, k, v, dout = (inputs.make(case, n, pos).to(device) for n in inputs.NAMES)
    t_in = time.perf_counter() - t_in
    ctx = RunContext(
        group=group, rank=grank, world_size=world, global_ranks=gl, layout=case.layout,
        lengths=tuple(case.seq_lens), all_positions=pos_all, mask=case.mask, softmax_scale=case.scale,
        dtype=q.dtype, device=device, seed=case.seed,
    )
    out, lse, grads, times = _forward_backward(impl, q, k, v, dout, ctx, phase, case.call, case.inputs)
    tensors = {"out": out}
    if grads is not None:
        tensors.update(zip(("dq", "dk", "dv"), grads, strict=True))
    if lse is not None:
        tensors["lse"] = lse
    t_pack = time.perf_counter()
    reply = {
        "tensors": {n: t.detach().cpu() for n, t in tensors.items()},
        "hashes": {n: tensor_hash(t) for n, t in tensors.items()},
        "timings": times,
    }
    times.update(inputs_s=t_in, pack_s=time.perf_counter() - t_pack)  # for the benchmarks' accounting
    # the leak run reads gradients: a call without a backward has none (its out is judged against the oracle)
    if leak and grads is not None and case.mask.kind != "none" and not case.faults:
        chosen = torch.isin(pos, inputs.leak_queries(case)).to(device)
        dout_s = torch.where(chosen.view(1, -1, 1, 1), dout, torch.zeros_like(dout))
        _, _, leak_grads, leak_times = _forward_backward(impl, q, k, v, dout_s, ctx,
                                                         lambda p: phase(p if p == "done" else f"leak-{p}"),
                                                         case.call, case.inputs)
        reply["leak"] = {"dk": leak_grads[1].detach().cpu(), "dv": leak_grads[2].detach().cpu()}
        times["leak_s"] = leak_times["forward_s"] + leak_times["backward_s"]
    return reply


def comm_budget(case: case_mod.Case) -> float:
    """Seconds from a case's start by which every communication op must have completed or failed,
    leaving the rest of the deadline for the error to reach the parent."""
    return max(0.5, case.deadline_s - max(0.5, min(2.0, 0.1 * case.deadline_s)))


def _interposer(case: case_mod.Case, rank: int, msg: RunMessage, workdir: str | None, stage: bool = False):
    """This rank's torch.distributed interposer for the case: op log, faults, short timeouts."""
    from harness.faults import interpose, schema

    def path(name: str) -> str | None:
        return os.path.join(workdir, f"{name}-{rank}") if workdir else None

    return interpose.Interposer(
        rank - case.group_offset, schema.parse_faults(case.faults, case.world_size), seed=case.seed,
        timeout_s=pg_timeout(case), budget_s=comm_budget(case), pending_path=path("pending"),
        note_path=path("faults"), case_id=msg.get("case_id"), stage=stage,
    )


PEERS_TAG = 0x5EED  # the tag of the receives `_close_peers` times out on purpose (never sent to)


def _close_peers(case: case_mod.Case, rank: int, groups: Groups) -> None:
    """After this rank raised mid-case: end the case on the other ranks at once instead of letting them
    wait out the backend's timeout. For each peer, a receive on the case's group is posted and timed
    out after 1 ms; gloo then closes the connection to that peer ("Application timeout caused pair
    closure"), so whatever the peer waits for from this rank fails immediately ("Connection closed by
    peer"), and its own error closes its connections in turn. The group is retired either way (the
    pool builds a fresh one for the next case). NCCL has no such pairs: its ranks end by the group's
    timeout, which follows the case deadline."""
    import torch.distributed as dist

    if case.world_size < 2 or not (case.group_offset <= rank < case.group_offset + case.world_size):
        return
    try:
        # only a group this case already made: creating one here (new_group is collective over the whole
        # pool) when the error came before it would desynchronise the ranks' group creation
        group = groups.cache.get((case.group_offset, case.world_size, round(pg_timeout(case), 3)))
        if group is None or dist.get_backend(group) != "gloo":
            return
        box = torch.empty(1)
        for peer in range(case.group_offset, case.group_offset + case.world_size):
            if peer == rank:
                continue
            try:
                dist.irecv(box, src=peer, group=group, tag=PEERS_TAG).wait(datetime.timedelta(milliseconds=1))
            except RuntimeError:
                pass  # the timeout we asked for: the pair to `peer` is closed
    except Exception:  # best effort: the peers still end by the group's timeout
        pass


def handle_case(msg: RunMessage, rank: int, groups: Groups, device: torch.device, impls: dict,
                workdir: str | None = None, stage: bool = False) -> ResultMessage:
    """Run one 'run' message on this (global) rank and build the reply; never raises for an
    implementation's error (that is a result). Shared by the pool worker and the torchrun driver.
    The case runs inside the fault interposer; the reply carries its op log and fired faults."""
    from harness.faults import interpose
    from harness.impls import registry

    case = case_mod.from_dict(msg["case"])
    reply = ResultMessage(op=RESULT, rank=rank, case_id=msg["case_id"], status=OK)
    ip = _interposer(case, rank, msg, workdir, stage)
    try:
        if msg.get("fresh_group"):
            groups.reset()
        group = groups.get(case.group_offset, case.world_size, pg_timeout(case))
        if not (case.group_offset <= rank < case.group_offset + case.world_size):
            reply["status"] = IDLE
            return reply
        spec = msg["impl"]
        if spec not in impls:
            impls[spec] = registry.resolve(spec, allow_import=msg.get("allow_import", False))
        reply["deterministic"] = bool(getattr(impls[spec], "deterministic", True))
        kernel = kernel_label(impls[spec])  # the flash-attn a flash-attn library ran on: cpu-standin, ...
        if kernel:
            reply["kernel"] = kernel
        with interpose.active(ip):
            reply.update(run_on_rank(case, impls[spec], group, device, msg.get("leak", True), ip.set_phase))
        reply["status"] = OK
    except ShapeError as e:
        reply.update(status=DIVERGED, error=_error_text(e), error_time=time.time())
        _close_peers(case, rank, groups)
    except Exception as e:  # the implementation's error is a result, not a worker crash
        reply.update(status=ERROR, error=_error_text(e), error_time=time.time(), where=_callers_frame(e),
                     traceback=traceback.format_exc()[-4000:])
        _close_peers(case, rank, groups)
    reply.update(comm=ip.compact_log(), faults=ip.report())
    return reply


def handle_oracle(msg: OracleMessage, rank: int, device: torch.device) -> OracleResultMessage:
    """One pass of this rank's share of a case's oracle (float64 reference + base: its own query rows against
    every key, or its own keys against every query given every row's statistics) on its own device. Runs
    outside the fault interposer and uses no process group: faults cannot touch it."""
    case = case_mod.from_dict(msg["case"])
    reply = OracleResultMessage(op=ORACLE_RESULT, rank=rank, case_id=msg["case_id"], status=OK)
    g = rank - case.group_offset
    if not 0 <= g < case.world_size:
        reply["status"] = IDLE
        return reply
    try:
        if msg["oracle_pass"] == "rows":
            reply["parts"] = reference.share_rows(case, g, device)
        else:
            reply["parts"] = reference.share_keys(case, g, msg["stats"], device)
    except Exception as e:  # e.g. out of memory: reported to the parent, which raises it as the harness's error
        reply.update(status=ERROR, error=_error_text(e))
    return reply


def _warm_up() -> None:
    """Do once at start what the first backward would otherwise do mid-ring: torch imports sympy on
    the first backward with a given gradient (seconds on a loaded machine), which made the other
    ranks' short-timeout waits fail on the first case after every pool (re)start."""
    x = torch.ones(1, requires_grad=True)
    torch.autograd.backward(x * 2, torch.ones(1))


@dataclass
class Serving:
    """What a pool worker keeps between messages."""

    rank: int
    conn: Connection
    groups: Groups
    device: torch.device
    workdir: str
    impls: dict[str, object]
    stage: bool = False  # P2P through host buffers (harness.faults.staging)


def on_run(st: Serving, msg: RunMessage) -> bool:
    """Run the case and send its result."""
    wire.send(st.conn, handle_case(msg, st.rank, st.groups, st.device, st.impls, st.workdir, st.stage))
    return True


def on_oracle(st: Serving, msg: OracleMessage) -> bool:
    """Compute one pass of this rank's oracle share and send it."""
    wire.send(st.conn, handle_oracle(msg, st.rank, st.device))
    return True


def on_ping(st: Serving, msg: Message) -> bool:
    """Answer that this rank is alive and idle."""
    wire.send(st.conn, PongMessage(op=PONG, rank=st.rank))
    return True


def on_stop(st: Serving, msg: Message) -> bool:
    """Leave the loop (the caller tears the process group down and exits)."""
    return False


# every message a worker answers, one handler each; a handler returns whether to keep serving
HANDLERS: dict[str, Callable[[Serving, Message], bool]] = {RUN: on_run, ORACLE: on_oracle, PING: on_ping,
                                                           STOP: on_stop}


def serve(rank: int, size: int, workdir: str, backend: str, placement: Placement | None = None) -> None:
    """Rendezvous, then loop: receive a message, hand it to its handler. Exits on 'stop' or parent death."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _warm_up()
    authkey = bytes.fromhex(os.environ["RING_HARNESS_AUTHKEY"])
    stack_file = open(os.path.join(workdir, f"stack-{rank}.txt"), "a")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a fatal signal (SIGSEGV in a backend) says where
    with Listener(os.path.join(workdir, f"rank{rank}.sock"), family="AF_UNIX", authkey=authkey) as lst:
        conn = lst.accept()
    placement = placement or Placement()
    backend = choose_backend(backend)
    device = device_for(backend) if backend == "nccl" else rank_device(placement, rank)
    if device.type == "cuda":  # the CUDA context now, not in the first case's ring (short timeouts)
        torch.ones(1, device=device).sum().item()
        if backend == "gloo":
            from harness.faults.staging import stage_functional_collectives

            stage_functional_collectives(device)
    if device.type == "cpu":  # CPU ranks: flash-attn's CPU stand-in, only where no real flash-attn is importable
        flash_standin.install()
    dist.init_process_group(
        backend, store=dist.FileStore(os.path.join(workdir, "store"), size), rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    st = Serving(rank, conn, Groups(backend), device, workdir, {}, placement.staged and backend == "gloo")
    wire.send(conn, ReadyMessage(op=READY, rank=rank, pid=os.getpid()))
    while True:
        try:
            msg = wire.recv(conn)
        except (EOFError, OSError):
            os._exit(0)
        handler = HANDLERS.get(msg.get("op"))
        if handler is None:
            raise ValueError(f"rank {rank}: unknown message op {msg.get('op')!r} (known: {', '.join(HANDLERS)})")
        if not handler(st, msg):
            break
    dist.destroy_process_group()
    conn.close()


def _preload() -> None:
    """What the zygote does once for all its children (harness.ranks.zygote): one intra-op thread, and, with a
    CPU-only torch (where it cannot touch a device), the autograd warm-up's imports."""
    torch.set_num_threads(1)
    if torch.version.cuda is None and torch.version.hip is None:
        _warm_up()


def main(argv: list[str] | None = None, zygote_pid: int | None = None) -> None:
    """Entry point of a worker process (arguments given by RankPool); `--zygote --parent PID` runs the zygote
    that forks them (harness.ranks.zygote)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--zygote"]:
        from harness.ranks import zygote

        zygote.serve(int(argv[argv.index("--parent") + 1]), _preload, main)
        return
    p = argparse.ArgumentParser(prog="harness.ranks.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--stage-p2p", action="store_true")
    a = p.parse_args(argv)
    _die_with_parent(zygote_pid or a.parent)  # a forked worker dies with its zygote, which dies with the owner
    serve(a.rank, a.size, a.dir, a.backend, Placement(a.device, a.stage_p2p))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
