"""gloo jobs for gloo/test_float8.py (each worker runs the job as its rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar as ap
from autopar.placement import shard_tensor
from tests.harness.meshes import MESHES
from tests.harness.models import MLP, MLP_TP
from tests.simulated.test_float8 import ADAMW


def float8_matches_serial(mesh_name, recipe):
    """ap.Float8 under ap.parallelize: this rank's gradients against the serial torchao model's
    (the amax all-reduces run as torch.distributed MAX all-reduces)."""
    import torchao.float8 as f8

    spec, rank = MESHES[mesh_name], dist.get_rank()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 16, generator=g)
    x[1, 5] = 40.0  # on dp rank 0 only
    torch.manual_seed(0)
    module = ap.parallelize(
        MLP(),
        spec.mesh(),
        args=(x,),
        annotations=MLP_TP if "tp" in spec.axes else {},
        data_parallel=spec.dp,
        float8=ap.Float8(recipe),
    )
    plan = module.autopar_plan
    (a,), _ = plan.local_inputs(rank, x)
    module(a).sin().square().mean().backward()  # test_float8.py's loss (see docs/float8.md: tolerances)
    torch.manual_seed(0)
    serial = f8.convert_to_float8_training(MLP(), config=f8.Float8LinearConfig.from_recipe_name(recipe))
    serial(x).sin().square().mean().backward()
    named = dict(serial.named_parameters())
    worst = 0.0
    for n, p in module.named_parameters():
        ref = shard_tensor(named[n].grad, plan.param_specs[n], plan.mesh, rank)
        worst = max(worst, ((p.grad - ref).abs().max() / named[n].grad.abs().max()).item())
    return worst


def fp8_gather_matches_serial():
    """zero=3 with the float8 weights all-gathered in fp8 (uint8 bytes through gloo) on dp2 x tp2:
    each rank's stored pieces after 2 AdamW steps against the serial torchao model's."""
    import torchao.float8 as f8

    from autopar.parallel.data_parallel.fsdp import stored

    rank, spec = dist.get_rank(), MESHES["dp2xtp2"]
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(8, 16, generator=g) for _ in range(2)]
    xs[0][1, 5] = 40.0  # on dp rank 0 only
    torch.manual_seed(0)
    module = ap.parallelize(
        MLP(),
        spec.mesh(),
        args=(xs[0],),
        annotations=MLP_TP,
        data_parallel=ap.DataParallel("dp", zero=3),
        float8=ap.Float8("tensorwise", fp8_all_gather=True),
    )
    plan = module.autopar_plan
    torch.manual_seed(0)
    serial = f8.convert_to_float8_training(MLP())
    for m in (module, serial):
        opt = torch.optim.AdamW(m.parameters(), **ADAMW)
        for x in xs:
            inp = plan.local_inputs(rank, x)[0][0] if m is module else x
            m(inp).sin().square().mean().backward()
            opt.step()
            opt.zero_grad()
    named, worst = dict(serial.named_parameters()), 0.0
    for n, p in module.named_parameters():
        ref = stored(plan, rank, n, shard_tensor(named[n].detach(), plan.param_specs[n], plan.mesh, rank))
        worst = max(worst, (p.detach() - ref).abs().max().item() if p.numel() else 0.0)
    return worst


def sequence_parallel_fp8_matches_serial(mesh_name):
    """Sequence parallel with tensor parallel's float8 collectives (the input gathered in fp8, the
    row-parallel output reduce-scattered and its gradient gathered in fp8: uint8 through gloo):
    this rank's gradients against the serial torchao model's, relative to the largest; and whether
    fp8 bytes crossed (the all-gathers' element sizes this rank ran)."""
    import torchao.float8 as f8

    from tests.simulated.test_float8_tp import SP, _batches, _loss, _model

    spec, rank = MESHES[mesh_name], dist.get_rank()
    x = _batches(1)[0]
    module = ap.parallelize(_model(), spec.mesh(), args=(x,), annotations=SP, data_parallel=spec.dp,
                            float8=ap.Float8("tensorwise"))  # fmt: skip
    plan = module.autopar_plan
    (a,), _ = plan.local_inputs(rank, x)
    with ap.comm_stats() as stats:
        _loss(module(a)).backward()
    serial = f8.convert_to_float8_training(_model())
    _loss(serial(x)).backward()
    named, worst = dict(serial.named_parameters()), 0.0
    for n, p in module.named_parameters():
        ref = shard_tensor(named[n].grad, plan.param_specs[n], plan.mesh, rank)
        worst = max(worst, ((p.grad - ref).abs().max() / named[n].grad.abs().max()).item())
    return worst, sorted({r.itemsize for r in stats.records if r.kind == "all_gather"})
