"""Pipeline jobs for the gloo pools, and the serial-comparison helpers the pipeline tests share."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.parallel.pipeline import with_pipeline
from autopar.placement import shard_tensor
from tests.models import MEGATRON, gpt_batch, small_gpt


class SkipNet(nn.Module):
    """Four blocks; block 0's output skips to blocks 2 and 3, a bool mask crosses to block 2,
    and block 1 hands two tensors to block 2 (multi-tensor boundaries)."""

    def __init__(self, d=16):
        super().__init__()
        self.b0, self.b1, self.b2, self.b3 = (nn.Linear(d, d) for _ in range(4))
        self.b1b = nn.Linear(d, d)

    def forward(self, x):
        a = torch.tanh(self.b0(x))
        mask = x > 0
        h = torch.tanh(self.b1(a))
        h2 = self.b1b(a)
        c = torch.where(mask, self.b2(h) * h2, h) + a
        return self.b3(c) + 0.5 * a


SKIP_SPLITS = {"b1": ap.split_before(), "b2": ap.split_before(), "b3": ap.split_before()}


def mse(out, labels):
    return F.mse_loss(out, labels)


def serial_step(model, batch, loss_fn=None, labels=None):
    """A deep copy of ``model`` trained one step on the whole batch: (loss, {name: grad})."""
    ref = copy.deepcopy(model)
    out = ref(*batch)
    loss = loss_fn(out, labels) if loss_fn else out[1]
    loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads


def grad_errors(plan, rank: int, runner, serial_grads: dict, rtol=1e-5, atol=1e-6) -> list[str]:
    """Every parameter this rank holds (tied names too) against its piece of the serial gradient."""
    bad = []
    for name, p in runner.params.items():
        if not isinstance(p, nn.Parameter):
            continue
        ref = shard_tensor(serial_grads[name], plan.param_specs[name], plan.mesh, rank)
        if p.grad is None or not torch.allclose(p.grad, ref, rtol=rtol, atol=atol):
            diff = None if p.grad is None else (p.grad - ref).abs().max().item()
            bad.append(f"rank {rank} {name}: max diff {diff}")
    return bad


def covered(runners_params: list[dict], model) -> set:
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return names - {n for d in runners_params for n in d}


# ---------------------------------------------------------------------------------- jobs
def _gpt_plan(shape, axes, dp, layers=4):
    model = small_gpt(layers=layers)
    idx, tg = gpt_batch(batch=8)
    ann = MEGATRON if "tp" in axes else {}
    plan = ap.plan(model, ap.Mesh(shape, axes), args=(idx, tg), annotations=ann, data_parallel=dp,
                   pipeline=ap.Pipeline("pp", microbatches=4))
    return model, plan, (idx, tg)


def gpt_pipeline_matches_serial(shape, axes, dp, configs):
    """For each (schedule, chunks, checkpoint): one real step; returns losses and gradient errors."""
    rank = dist.get_rank()
    model, plan, batch = _gpt_plan(shape, axes, dp)
    serial_loss, serial_grads = serial_step(model, batch)
    out = []
    for schedule, chunks, ckpt in configs:
        p = with_pipeline(plan, ap.Pipeline("pp", microbatches=4, schedule=schedule, chunks=chunks,
                                            checkpoint=ckpt))
        runner = p.pipeline_runner(rank)
        loss = runner.step(batch)
        out.append({"config": (schedule, chunks, ckpt), "loss": loss.item(), "serial": serial_loss.item(),
                    "errors": grad_errors(p, rank, runner, serial_grads), "names": sorted(runner.params),
                    "stats": runner.stats})
    return out


def gpt_pipeline_sgd(shape, axes, dp, steps=2, lr=0.1):
    """Two SGD steps with the runner's parameters; returns the loss curve and serial's."""
    rank = dist.get_rank()
    model, plan, _ = _gpt_plan(shape, axes, dp)
    serial = copy.deepcopy(model)
    runner = plan.pipeline_runner(rank)
    opt = torch.optim.SGD(runner.parameters(), lr=lr)
    sopt = torch.optim.SGD(serial.parameters(), lr=lr)
    losses, serial_losses = [], []
    for step in range(steps):
        batch = gpt_batch(batch=8, seed=step + 10)
        losses.append(runner.step(batch).item())
        opt.step()
        opt.zero_grad()
        _, sl = serial(*batch)
        sl.backward()
        sopt.step()
        sopt.zero_grad()
        serial_losses.append(sl.item())
    worst = 0.0
    named = dict(serial.named_parameters(remove_duplicate=False))
    for name, p in runner.params.items():
        if isinstance(p, nn.Parameter):
            ref = shard_tensor(named[name].detach(), plan.param_specs[name], plan.mesh, rank)
            worst = max(worst, ((p.detach() - ref).abs().max() / ref.abs().max()).item())
    return {"losses": losses, "serial": serial_losses, "max_rel_param": worst}


def skipnet_matches_serial():
    """SkipNet on 4 real ranks: skips over stages, a bool mask and two tensors at once."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SkipNet()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    plan = ap.plan(model, ap.Mesh((4,), ("pp",)), args=(x,), annotations=SKIP_SPLITS,
                   pipeline=ap.Pipeline("pp", microbatches=2, schedule="1f1b", loss=mse))
    serial_loss, serial_grads = serial_step(model, (x,), mse, y)
    runner = plan.pipeline_runner(rank)
    loss = runner.step((x,), y)
    errors = grad_errors(plan, rank, runner, serial_grads)
    # Another batch size: boundary shapes change between steps (each step's first message of a
    # value carries its shape; the later ones are received into buffers posted ahead).
    x2, y2 = torch.randn(12, 16), torch.randn(12, 16)
    runner.holder.zero_grad(set_to_none=True)
    loss2 = runner.step((x2,), y2)
    serial2, grads2 = serial_step(model, (x2,), mse, y2)
    return {"loss": loss.item(), "serial": serial_loss.item(), "loss2": loss2.item(), "serial2": serial2.item(),
            "errors": errors + grad_errors(plan, rank, runner, grads2)}
