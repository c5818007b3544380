"""One case on this rank: its shards, the implementation's call, the reply.

The shards of q, k, v and dout are rebuilt from the case's seed. The implementation is called the
case's way (harness.calls), forward then backward, inside the fault interposer. A leak run follows
when the mask hides keys. An implementation's error is a result, not a crash: it goes back in the
reply. The pool worker and the torchrun driver both run cases through `handle_case` and
`handle_oracle`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import sysconfig
import time
import traceback

import torch

from harness import calls, inputs, paged, serving_case
from harness import case as case_mod
from harness.context import RunContext, ServingInfo
from harness.errors import ShapeError
from harness.faults import interpose, schema
from harness.impls import registry
from harness.impls.adapters._common import kernel_label
from harness.oracle import shares
from harness.ranks import instrument
from harness.ranks.groups import Groups
from harness.ranks.groups import key as group_key
from harness.ranks.protocol import (
    DIVERGED,
    ERROR,
    IDLE,
    OK,
    ORACLE_RESULT,
    RESULT,
    OracleMessage,
    OracleResultMessage,
    ResultMessage,
    RunMessage,
)
from ring_impl.serving import local_lengths
from ring_impl.variants import alibi_slopes


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes: equal hashes mean bit-identical results."""
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _error_text(e: BaseException) -> str:
    """One line: exception type, message, and the innermost frame it came from."""
    tb = traceback.extract_tb(e.__traceback__)
    where = (
        f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    )
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}{where}"


def _callers_frame(e: BaseException) -> str:
    """'file:line in function' of the implementation's own call that raised.

    It is the innermost frame outside the harness, torch and the standard library. It is '' when
    every frame is the harness's.
    """
    skip = (
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.path.dirname(torch.__file__),
        sysconfig.get_paths()["stdlib"],
    )
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        path = os.path.abspath(fr.filename)
        if not path.startswith(skip):
            return (
                f"{os.path.relpath(path) if not os.path.relpath(path).startswith('..') else path}:{fr.lineno} "
                f"in {fr.name}"
            )
    return ""


_LAST_CASE: list = [None, None]  # [the last message's case dict, its Case]


def _case_of(d: dict) -> case_mod.Case:
    """The message's case, parsed once: the oracle's passes send the run's case again."""
    if _LAST_CASE[0] != d:
        _LAST_CASE[:] = [d, case_mod.from_dict(d)]
    return _LAST_CASE[1]


def pg_timeout(case: case_mod.Case) -> float:
    """The process-group timeout for a case.

    It is well inside the case's deadline, so the ranks fail before the parent's watchdog steps in.
    """
    return max(1.0, min(case.deadline_s * 0.5, case.deadline_s - 2.0))


def _split(res):
    if isinstance(res, (tuple, list)):
        if len(res) != 2:
            raise ShapeError(
                f"implementation returned {len(res)} values; expected out or (out, lse)"
            )
        return res[0], res[1]
    return res, None


def _no_phase(phase: str) -> None:
    """Phase marker when no interposer listens."""


def _run_call(impl, q, k, v, dout, ctx, call: str, form: str, phase, times: dict, leak_dout=None):
    """The forward as `call` makes it, on inputs in `form` (harness.calls), then the backward if
    any.

    It returns (out, lse, (dq, dk, dv, dsinks) or None, leak (dk, dv) or None). `times` gets
    forward_s and backward_s. With `leak_dout`, a second backward through the same graph gives
    the leak run's dk and dv (`leak_s`), where the call allows it (`calls.RETAINED_LEAK`).
    """

    def fn(q, k, v):
        return _split(impl.run(q, k, v, ctx))

    grad = calls.needs_backward(call)
    mode = torch.inference_mode() if call == "inference-mode" else contextlib.nullcontext()
    # A serving model makes its q, k, v under inference_mode too.
    with mode:
        x = calls.present(form, q, k, v, dout, grad)
        if ctx.serving is not None and ctx.serving.page_size:
            x, ctx = paged.present(x, ctx, grad)
        phase("forward")
        t0 = time.perf_counter()
        out, lse = calls.forward(call, fn, x.q, x.k, x.v)
        times.update(forward_s=time.perf_counter() - t0, backward_s=0.0)
    want = (*q.shape[:3], v.shape[-1])  # v's head dim: the value head dim of MLA
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ShapeError(f"output shape {got} != expected {want}")
    if not grad:
        return out, lse, None, None
    if not out.requires_grad:
        raise RuntimeError(
            "the output does not require grad: the ring ran no autograd graph (a "
            "forward-only "
            "ring? Capabilities(backward=False))"
        )
    retain = leak_dout is not None and call in calls.RETAINED_LEAK
    phase("backward")
    t1 = time.perf_counter()
    torch.autograd.backward(out, x.dout, retain_graph=retain)
    times["backward_s"] = time.perf_counter() - t1
    grads = (*_checked_grads(x, (q, k, v)), _sinks_grad(ctx))
    if not retain:
        return out, lse, grads, None
    for t in x.leaves:  # the leak's gradients land in fresh tensors, not added to the first
        t.grad = None
    phase("leak-backward")
    t2 = time.perf_counter()
    torch.autograd.backward(out, calls.present_dout(form, leak_dout))
    times["leak_s"] = time.perf_counter() - t2
    leak = _checked_grads(x, (q, k, v))[1:]
    _sinks_grad(ctx)  # cleared: the leak run judges dk and dv only
    return out, lse, grads, leak


def _checked_grads(x, shards) -> list[torch.Tensor]:
    """dq, dk, dv from the presented leaves, each present and of its shard's shape."""
    grads = []
    for name, g, t in zip(("q", "k", "v"), x.grads(), shards, strict=True):
        if g is None:
            raise ShapeError(f"implementation produced no gradient for {name}")
        if tuple(g.shape) != tuple(t.shape):
            raise ShapeError(f"d{name} shape {tuple(g.shape)} != expected {tuple(t.shape)}")
        grads.append(g)
    return grads


def _sinks_grad(ctx: RunContext) -> torch.Tensor | None:
    """The sinks' gradient, read and cleared (a second call starts from none).

    A ring that never used the sinks leaves no gradient: it reads as zero, which is what such a
    ring computed, and is judged against the oracle's.
    """
    sinks = ctx.sinks
    if sinks is None or not sinks.requires_grad:
        return None
    g = sinks.grad if sinks.grad is not None else torch.zeros_like(sinks)
    sinks.grad = None
    return g.detach().clone()


def _forward_backward(
    impl,
    q,
    k,
    v,
    dout,
    ctx,
    phase=_no_phase,
    call: str = "train",
    form: str = "contiguous",
    leak_dout=None,
):
    """One call of the implementation, on inputs in `form`.

    The call is one of harness.calls: train, no-grad, checkpoint... It returns (out, lse, grads or
    None, leak grads or None, times). `phase` is told forward, backward, leak-backward or done, so
    the comm log and the fault schedule know which.
    """
    times: dict = {}
    out, lse, grads, leak = _run_call(impl, q, k, v, dout, ctx, call, form, phase, times, leak_dout)
    phase("done")
    return out, lse, grads, leak, times


def _context(case, group, grank, global_ranks, pos_all, dtype, device) -> RunContext:
    """This rank's RunContext for the case: its ring, positions, mask and variants."""
    sinks = slopes = None
    if case.sinks is not None:
        grad = calls.needs_backward(case.call)
        sinks = torch.tensor(case.sinks, dtype=torch.float32, device=device, requires_grad=grad)
    if case.alibi:
        slopes = torch.tensor(alibi_slopes(case.heads_q), dtype=torch.float32, device=device)
    return RunContext(
        group=group,
        rank=grank,
        world_size=case.world_size,
        global_ranks=global_ranks,
        layout=case.layout,
        lengths=tuple(case.seq_lens),
        all_positions=pos_all,
        mask=case.mask,
        softmax_scale=case.scale,
        dtype=dtype,
        device=device,
        seed=case.seed,
        sinks=sinks,
        softcap=case.softcap,
        alibi_slopes=slopes,
        head_dim_v=case.head_dim_v,
        query_positions=None if case.serving is None else serving_case.query_positions(case),
        serving=None if case.serving is None else serving_info(case.serving, case.world_size),
    )


def serving_info(req, world_size: int) -> ServingInfo:
    """What a rank is told of a serving case's requests (`RunContext.serving`)."""
    return ServingInfo(
        context=req.context,
        new=req.new,
        starts=req.starts,
        kv=req.kv,
        interleave=req.interleave,
        queries=req.queries,
        kv_lengths=tuple(local_lengths(req, world_size)),
        page_size=req.page_size,
    )


def _natural_lse(lse: torch.Tensor, impl) -> torch.Tensor:
    """The lse in natural log: one declared in base 2 (`Capabilities.lse_base`) times ln 2."""
    caps = getattr(impl, "capabilities", None)
    if getattr(caps, "lse_base", "e") == "2" and isinstance(lse, torch.Tensor):
        return lse.detach().double().mul(LN2).to(lse.dtype)
    return lse


LN2 = 0.6931471805599453


def run_on_rank(
    case: case_mod.Case, impl, group, device: torch.device, leak: bool, phase=_no_phase
) -> dict:
    """Run one case on this rank: shards from the seed, forward and backward, then the leak run.

    The leak run is skipped under faults: the fault schedule counts the ops of one forward and
    backward.
    """
    import torch.distributed as dist

    grank = dist.get_rank(group) if group is not None else 0
    world_size = case.world_size
    gl = (
        tuple(dist.get_global_rank(group, r) for r in range(world_size))
        if group is not None
        else (0,)
    )
    pos_all = serving_case.kv_positions(case)
    pos, q_pos = pos_all[grank], serving_case.query_positions(case)[grank]
    t_in = time.perf_counter()
    q, k, v, dout = (
        inputs.make(case, n, q_pos if n in ("q", "dout") else pos).to(device) for n in inputs.NAMES
    )
    t_in = time.perf_counter() - t_in
    ctx = _context(case, group, grank, gl, pos_all, q.dtype, device)
    # the leak run reads gradients: a call without a backward has none (its out is judged against
    # the oracle). A serving case's leak run is left out: its queries are not its keys
    # (docs/case-model.md). Under faults it is left out too: the fault schedule counts the ops of
    # one forward and backward.
    serve = case.serving is not None
    leak = leak and calls.needs_backward(case.call) and case.mask.kind != "none"
    leak = leak and not case.faults and not serve
    leak_dout = None
    if leak:
        chosen = torch.isin(pos, inputs.leak_queries(case)).to(device)
        leak_dout = torch.where(chosen.view(1, -1, 1, 1), dout, torch.zeros_like(dout))
    out, lse, grads, leak_grads, times = _forward_backward(
        impl, q, k, v, dout, ctx, phase, case.call, case.inputs, leak_dout
    )
    tensors = {"out": out}
    if grads is not None:
        tensors.update(zip(("dq", "dk", "dv"), grads[:3], strict=True))
        if grads[3] is not None:
            tensors["dsinks"] = grads[3]
    if lse is not None:
        tensors["lse"] = _natural_lse(lse, impl)
    t_pack = time.perf_counter()
    reply = {
        "tensors": {n: t.detach().cpu() for n, t in tensors.items()},
        "hashes": {n: tensor_hash(t) for n, t in tensors.items()},
        "timings": times,
    }
    # for the benchmarks' accounting
    times.update(inputs_s=t_in, pack_s=time.perf_counter() - t_pack)
    if leak and leak_grads is None:  # a call that cannot retain its graph: a second call
        _, _, leak_grads, _, leak_times = _forward_backward(
            impl,
            q,
            k,
            v,
            leak_dout,
            ctx,
            lambda p: phase(p if p == "done" else f"leak-{p}"),
            case.call,
            case.inputs,
        )
        leak_grads = leak_grads[1:3]
        times["leak_s"] = leak_times["forward_s"] + leak_times["backward_s"]
    if leak_grads is not None:
        reply["leak"] = {"dk": leak_grads[0].detach().cpu(), "dv": leak_grads[1].detach().cpu()}
    return reply


def comm_budget(case: case_mod.Case) -> float:
    """Seconds from a case's start by which every communication op must have completed or failed.

    The rest of the deadline is left for the error to reach the parent.
    """
    return max(0.5, case.deadline_s - max(0.5, min(2.0, 0.1 * case.deadline_s)))


def _interposer(
    case: case_mod.Case, rank: int, msg: RunMessage, workdir: str | None, stage: bool = False
):
    """This rank's torch.distributed interposer for the case: op log, faults and short timeouts."""

    def path(name: str) -> str | None:
        return os.path.join(workdir, f"{name}-{rank}") if workdir else None

    return interpose.Interposer(
        rank - case.group_offset,
        schema.parse_faults(case.faults, case.world_size),
        seed=case.seed,
        timeout_s=pg_timeout(case),
        budget_s=comm_budget(case),
        pending_path=path("pending"),
        note_path=path("faults"),
        case_id=msg.get("case_id"),
        stage=stage,
        ring=range(case.group_offset, case.group_offset + case.world_size),
    )


# The tag of the receives that `_close_peers` times out on purpose. Nothing is sent to it.
PEERS_TAG = 0x5EED


def _close_peers(case: case_mod.Case, rank: int, groups: Groups) -> None:
    """After this rank raised mid-case, end the case on the other ranks at once.

    Otherwise they would wait out the backend's timeout. docs/check.md ("Fail-stop in seconds") says
    what the user sees. Under gloo, for each peer, a receive on the case's group is posted and timed
    out after 1 ms. Gloo then closes the connection to that peer ("Application timeout caused pair
    closure"). Whatever the peer waits for from this rank fails at once ("Connection closed by
    peer"), and its own error closes its connections in turn. The group is retired either way: the
    pool builds a fresh one for the next case. NCCL has no such pairs. Its ranks end by the group's
    timeout, which follows the case deadline.
    """
    import torch.distributed as dist

    if case.world_size < 2 or not (case.group_offset <= rank < case.group_offset + case.world_size):
        return
    try:
        # only a group this case already made: creating one here (new_group is collective over the
        # whole pool) when the error came before it would desynchronise the ranks' group creation
        group = groups.cache.get(group_key(case.group_offset, case.world_size, pg_timeout(case)))
        if group is None or dist.get_backend(group) != "gloo":
            return
        box = torch.empty(1)
        for peer in range(case.group_offset, case.group_offset + case.world_size):
            if peer == rank:
                continue
            try:
                dist.irecv(box, src=peer, group=group, tag=PEERS_TAG).wait(
                    datetime.timedelta(milliseconds=1)
                )
            except RuntimeError:
                # The timeout we asked for: the pair to `peer` is closed.
                pass
    # Best effort: the peers still end by the group's timeout.
    except Exception:
        pass


def handle_case(
    msg: RunMessage,
    rank: int,
    groups: Groups,
    device: torch.device,
    impls: dict,
    workdir: str | None = None,
    stage: bool = False,
) -> ResultMessage:
    """Run one 'run' message on this global rank and build the reply.

    It never raises for an implementation's error, which is a result. The pool worker and the
    torchrun driver share it. The case runs inside the fault interposer, and the reply carries its
    op log and the faults that fired.
    """
    case = _case_of(msg["case"])
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
        # the flash-attn a flash-attn library ran on: cpu-standin, ...
        kernel = kernel_label(impls[spec])
        if kernel:
            reply["kernel"] = kernel
        profile = bool(msg.get("profile", False))
        watch = instrument.profiled(ip, device) if profile else contextlib.nullcontext(None)
        with interpose.active(ip), watch as measured:
            # a profiled call runs once: no leak run
            leak = msg.get("leak", True) and not profile
            reply.update(run_on_rank(case, impls[spec], group, device, leak, ip.set_phase))
        if measured is not None:
            reply["profile"] = measured
        reply["status"] = OK
    except ShapeError as e:
        reply.update(status=DIVERGED, error=_error_text(e), error_time=time.time())
        _close_peers(case, rank, groups)
    # The implementation's error is a result, not a worker crash.
    except Exception as e:
        reply.update(
            status=ERROR,
            error=_error_text(e),
            error_time=time.time(),
            where=_callers_frame(e),
            traceback=traceback.format_exc()[-4000:],
        )
        _close_peers(case, rank, groups)
    reply.update(comm=ip.compact_log(), faults=ip.report())
    return reply


def handle_oracle(msg: OracleMessage, rank: int, device: torch.device) -> OracleResultMessage:
    """One pass of this rank's share of a case's oracle, float64 and base, on its own device.

    The first pass is its own query rows against every key. The second is its own keys against every
    query, given every row's statistics. It runs outside the fault interposer and uses no process
    group, so faults cannot touch it.
    """
    case = _case_of(msg["case"])
    reply = OracleResultMessage(op=ORACLE_RESULT, rank=rank, case_id=msg["case_id"], status=OK)
    g = rank - case.group_offset
    if not 0 <= g < case.world_size:
        reply["status"] = IDLE
        return reply
    try:
        if msg["oracle_pass"] == "rows":
            reply["parts"] = shares.share_rows(case, g, device)
        else:
            reply["parts"] = shares.share_keys(case, g, msg["stats"], device)
    # e.g. out of memory: reported to the parent, which raises it as the harness's error
    except Exception as e:
        reply.update(status=ERROR, error=_error_text(e))
    return reply
