"""gloo jobs for expert parallelism (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar as ap
from tests.harness import moe as M
from tests.harness import moe_lists as L
from tests.harness.distributed import merged_parameters
from tests.harness.serial import max_rel_diff


def three_adamw_steps(kind: str, shape: tuple, routed: bool, expert_tp: bool = False):
    """3 AdamW steps of ap.parallelize with the experts on dp (tokens dispatched by all-to-all)
    on real processes; rank 0 returns the worst relative difference from serial, every rank the
    number of expert-weight elements it holds and the collectives it ran in one step."""
    mesh = ap.Mesh(shape, ("dp", "tp")[: len(shape)])
    listed = kind.endswith("_list")  # HF's loop over a per-expert ModuleList (tests/harness/moe_lists.py)
    routed_model = (lambda: L.RoutedListExperts(kind[: -len("_list")])) if listed else (lambda: M.RoutedExperts(kind))
    if routed:  # HF's experts module fed a routing with one expert never chosen
        batches = [M.routing(16, seed=s) for s in range(3)]
        tp = "tp" if expert_tp else None  # each expert's linears split over tp too
        model, ann, ex = routed_model(), {"experts": ap.expert_parallel("dp", tp=tp)}, dict(args=batches[0])
    else:
        model, kw = M.moe_model(kind)
        batches = [kw] + [M.moe_model(kind, seed=s)[1] for s in (5, 6)]
        ann, ex = dict(M.EP), dict(kwargs=kw)
        if len(shape) > 1:
            preset = ap.presets.megatron(model, "tp", kwargs=kw, expert_axis="dp", vocab=False, expert_tp=expert_tp)
            ann = dict(preset)
    module = ap.parallelize(model, mesh, annotations=ann, data_parallel="dp", dynamic=False, **ex)
    plan, rank = module.autopar_plan, dist.get_rank()
    eps = 1e-8 if routed else 1e-3  # whole models: eps above the gradients' float noise (test_expert_parallel.py)
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1, eps=eps)
    with ap.comm_stats() as stats:
        for b in batches:
            args, kwargs = plan.local_inputs(rank, *b) if isinstance(b, tuple) else plan.local_inputs(rank, **b)
            M.loss_of(module(*args, **kwargs)).backward()
            opt.step()
            opt.zero_grad()
    kinds = sorted({r.kind for r in stats.for_rank(rank)})
    ran = sum(r.kind == "all_to_all" for r in stats.for_rank(rank))
    planned = sum(c.kind == "all_to_all" for c in plan.collectives())
    assert ran == len(batches) * planned, (ran, planned)  # the plan lists what runs: 5 per layer and step
    mine = {n: p.detach().clone() for n, p in module.named_parameters()}
    held = sum(p.numel() for n, p in mine.items() if "experts." in n)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None, held, kinds
    serial = routed_model() if routed else M.moe_model(kind)[0]
    return max_rel_diff(plan.merge_state_dicts(gathered), M.train_serial(serial, batches, eps=eps)), held, kinds


def _step_and_save(module, batch, path: str):
    """One AdamW step of the rank module on its piece of ``batch``, saved through DCP at ``path``:
    (the saved state dict, every rank's parameters merged into the serial ones)."""
    opt = torch.optim.AdamW(module.parameters(), lr=0.01)
    args, _ = module.autopar_plan.local_inputs(dist.get_rank(), *batch)
    M.loss_of(module(*args)).backward()
    opt.step()
    model_sd, _ = ap.get_state_dict(module)
    dcp.save({"model": model_sd}, checkpoint_id=path)
    return model_sd, merged_parameters(module)


def list_experts_save(path: str):
    """A ModuleList's experts on dp=4 (expert i whole on its rank), one AdamW step, saved through
    DCP, then loaded on every rank into a plain serial model's state dict: (whether the saved
    keys are the serial model's, the worst difference from the merged ranks' parameters)."""
    batch = M.routing(16)
    ann = {"experts": ap.expert_parallel("dp")}
    module = ap.parallelize(
        L.RoutedListExperts(), ap.Mesh((4,), ("dp",)), args=batch, annotations=ann, data_parallel="dp"
    )
    model_sd, want = _step_and_save(module, batch, path)
    if dist.get_rank() == 0:
        torch.save(want, path + ".want.pt")
    serial = {n: torch.zeros_like(t) for n, t in L.RoutedListExperts().state_dict().items()}
    dcp.load({"model": serial}, checkpoint_id=path)
    return sorted(model_sd) == sorted(serial), max((serial[n] - want[n]).abs().max().item() for n in want)


def list_experts_load(path: str):
    """That checkpoint loaded into a dp=2 plan of the same ModuleList: the worst difference."""
    batch = M.routing(16)
    ann = {"experts": ap.expert_parallel("dp")}
    module = ap.parallelize(
        L.RoutedListExperts(seed=1), ap.Mesh((2,), ("dp",)), args=batch, annotations=ann, data_parallel="dp"
    )
    sd, _ = ap.get_state_dict(module)
    dcp.load({"model": sd}, checkpoint_id=path)
    ap.set_state_dict(module, model_state_dict=sd)
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, {n: p.detach().clone() for n, p in module.named_parameters()})
    got, want = module.autopar_plan.merge_state_dicts(pieces), torch.load(path + ".want.pt")
    return max((got[n] - want[n]).abs().max().item() for n in want)


def compiled_step(kind: str):
    """torch.compile (aot_eager) of a rank module with the experts dispatched on dp=4: one step's
    output and gradients against the eager module's, and against serial through the merged
    gradients; (worst difference from eager, from serial, graph breaks, graphs compiled) on
    this rank."""
    from torch._dynamo.utils import counters

    batch = M.routing(16)
    build = (lambda: L.RoutedListExperts("mixtral")) if kind == "mixtral_list" else (lambda: M.RoutedExperts(kind))
    ann = {"experts": ap.expert_parallel("dp")}
    module = ap.parallelize(build(), ap.Mesh((4,), ("dp",)), args=batch, annotations=ann, data_parallel="dp")
    plan, rank = module.autopar_plan, dist.get_rank()
    args, _ = plan.local_inputs(rank, *batch)

    def step(m):
        module.zero_grad(set_to_none=True)
        out = m(*args)
        M.loss_of(out).backward()
        return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}

    eager_out, eager = step(module)
    torch._dynamo.reset()
    counters.clear()
    out, grads = step(torch.compile(module, backend="aot_eager"))
    breaks = {}  # the reasons' first lines (with the operator where dynamo names one) -> count
    for reason, count in counters["graph_break"].items():
        op = reason.split("Operator `")[1].split("`")[0] if "Operator `" in reason else ""
        key = reason.splitlines()[0] + (f": {op}" if op else "")
        breaks[key] = breaks.get(key, 0) + count
    graphs = counters["stats"]["unique_graphs"]
    vs_eager = max(
        [(out - eager_out).abs().max().item()]
        + [(grads[n] - eager[n]).abs().max().item() for n in eager if eager[n].numel()]
    )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    serial = build()
    M.loss_of(serial(*batch)).backward()
    want = {n: p.grad for n, p in serial.named_parameters()}
    merged = plan.merge_state_dicts(gathered)
    vs_serial = max(
        ((merged[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item()
        for n in want
        if want[n].numel()
    )
    return vs_eager, vs_serial, breaks, graphs


def sub_axis_three_adamw_steps(kind: str, axis: str = "b"):
    """3 AdamW steps with the batch over two mesh axes (a, b) and the experts over ``axis`` only
    (b: the all-to-alls inside each group of b's ranks, the experts' gradients summed over a; a:
    the other way round), on real processes; rank 0 returns the worst relative difference from
    serial, every rank the number of expert-weight elements it holds and the groups its
    collectives ran on."""
    mesh = ap.Mesh((2, 2), ("a", "b"))
    batches = [M.routing(16, seed=s) for s in range(3)]
    model = M.RoutedExperts(kind)
    dp = ap.DataParallel("b", replicate_axis="a")
    ann = {"experts": ap.expert_parallel(axis)}
    module = ap.parallelize(model, mesh, annotations=ann, data_parallel=dp, dynamic=False, args=batches[0])
    plan, rank = module.autopar_plan, dist.get_rank()
    opt = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)
    with ap.comm_stats() as stats:
        for b in batches:
            args, kwargs = plan.local_inputs(rank, *b)
            M.loss_of(module(*args, **kwargs)).backward()
            opt.step()
            opt.zero_grad()
    groups = sorted({(r.kind, r.group) for r in stats.for_rank(rank)})
    mine = {n: p.detach().clone() for n, p in module.named_parameters()}
    held = sum(p.numel() for n, p in mine.items() if "experts." in n)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None, held, groups
    serial = M.train_serial(M.RoutedExperts(kind), batches, eps=1e-3)
    return max_rel_diff(plan.merge_state_dicts(gathered), serial), held, groups


def sub_axis_checkpoint(path: str):
    """Stacked experts over b with the batch over (a, b) = (2, 2), one AdamW step, saved through
    DCP; loaded into a plain serial state dict and back into a fresh plan of the same layout:
    (whether the keys are the serial model's, the worst difference in each)."""
    batch = M.routing(16)
    mesh, dp = ap.Mesh((2, 2), ("a", "b")), ap.DataParallel("b", replicate_axis="a")
    ann = {"experts": ap.expert_parallel("b")}
    module = ap.parallelize(M.RoutedExperts("mixtral"), mesh, args=batch, annotations=ann, data_parallel=dp)
    model_sd, want = _step_and_save(module, batch, path)
    serial = {n: torch.zeros_like(t) for n, t in M.RoutedExperts("mixtral").state_dict().items()}
    dcp.load({"model": serial}, checkpoint_id=path)
    again = ap.parallelize(M.RoutedExperts("mixtral", seed=1), mesh, args=batch, annotations=ann, data_parallel=dp)
    sd, _ = ap.get_state_dict(again)
    dcp.load({"model": sd}, checkpoint_id=path)
    ap.set_state_dict(again, model_state_dict=sd)
    got = merged_parameters(again)
    mine = {n: p.detach() for n, p in again.named_parameters()}
    local_ok = all(torch.equal(mine[n], m.detach()) for n, m in module.named_parameters())
    worst = [max((d[n] - want[n]).abs().max().item() for n in want) for d in (serial, got)]
    return sorted(model_sd) == sorted(serial), worst, local_ok
