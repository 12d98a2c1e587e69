"""Hand-written Megatron-style tensor parallelism in plain torch: the benchmarks' floor.

What a careful user writes by hand (Shoeybi et al., 2019): a column-parallel linear keeps
its rows of the weight and bias and applies "f" to its input (identity forward, all-reduce
of the gradient backward); a row-parallel linear keeps its columns of the weight, applies
"g" to its output (all-reduce forward, identity backward) and adds the whole bias once,
after the reduction. f and g are plain ``autograd.Function``s calling torch.distributed
directly: nothing between the model and the collective.

Example:
    >>> tp = megatronize(serial_gpt, rank, world, {"qkv": "col", "proj": "row"}, heads=True)
    >>> logits, loss = tp(idx, targets)       # under an initialised process group
"""

from __future__ import annotations

import copy
import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()  # a fresh tensor (linear's output): reduce it in place
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class ColumnParallelLinear(nn.Module):
    """y_local = f(x) @ W[rows of this rank].T + b[rows of this rank]."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        n = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * n : (rank + 1) * n].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rank * n : (rank + 1) * n].clone())

    def forward(self, x):
        return F.linear(_CopyToParallel.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W[:, columns of this rank].T) + b (the bias added once, after the sum)."""

    def __init__(self, full: nn.Linear, rank: int, world: int):
        super().__init__()
        n = full.in_features // world
        self.weight = nn.Parameter(full.weight.detach()[:, rank * n : (rank + 1) * n].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        y = _ReduceFromParallel.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def megatronize(model: nn.Module, rank: int, world: int, styles: dict[str, str]) -> nn.Module:
    """A deep copy of ``model`` with the linears matching ``styles`` patterns ("col"/"row")
    replaced by their parallel versions; attention modules with ``n_head`` get their local
    head count (the column split of a heads-major qkv is a split of whole heads)."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        style = next((s for pat, s in styles.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        cls = ColumnParallelLinear if style == "col" else RowParallelLinear
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, cls(module, rank, world))
    for module in model.modules():
        if hasattr(module, "n_head") and hasattr(module, "qkv"):
            module.n_head //= world
    return model


GPT_STYLES = {
    "blocks.*.attn.qkv": "col",
    "blocks.*.attn.proj": "row",
    "blocks.*.mlp.fc": "col",
    "blocks.*.mlp.proj": "row",
}
MLP_STYLES = {"layers.*.fc1": "col", "layers.*.fc2": "row"}


def max_grad_error(serial: nn.Module, tp: nn.Module, args, loss_of, rank: int, world: int) -> float:
    """Largest relative difference between ``tp``'s gradients (one training step, this rank's
    pieces) and the matching pieces of the serial model's: the reference must itself be exact."""
    serial = copy.deepcopy(serial)
    loss_of(serial(*args)).backward()
    loss_of(tp(*args)).backward()
    worst = 0.0
    full = dict(serial.named_parameters())
    owners = {f"{n}.{p}": m for n, m in tp.named_modules() for p, _ in m.named_parameters(recurse=False)}
    for name, p in tp.named_parameters():
        g = full[name].grad
        m = owners[name]
        if isinstance(m, ColumnParallelLinear):
            n = g.shape[0] // world
            g = g[rank * n : (rank + 1) * n]
        elif isinstance(m, RowParallelLinear) and name.endswith("weight"):
            n = g.shape[1] // world
            g = g[:, rank * n : (rank + 1) * n]
        worst = max(worst, ((p.grad - g).abs().max() / g.abs().max().clamp_min(1e-12)).item())
        p.grad = None
    return worst
