"""Small models for tests (no downloads): MLP stacks and the package's GPT."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig

MEGATRON = {"blocks.*.attn.qkv": ap.colwise("tp"), "blocks.*.attn.proj": ap.rowwise("tp"),
            "blocks.*.mlp.fc": ap.colwise("tp"), "blocks.*.mlp.proj": ap.rowwise("tp")}

MESHES = {  # name -> (shape, axis names, data-parallel axis, annotations)
    "tp2": ((2,), ("tp",), None, MEGATRON),
    "tp4": ((4,), ("tp",), None, MEGATRON),
    "dp2xtp2": ((2, 2), ("dp", "tp"), "dp", MEGATRON),
}


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, layers=2, bias=True):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(d, hidden, bias=bias), "fc2": nn.Linear(hidden, d, bias=bias)})
            for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["fc2"](F.relu(layer["fc1"](x)))
        return self.norm(x)


MLP_TP = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}


def small_gpt(tied=True, layers=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=32, tied=tied))


def gpt_batch(batch=8, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def mesh_and_plan(name, model, args):
    shape, axes, dp, ann = MESHES[name]
    mesh = ap.Mesh(shape, axes)
    return ap.plan(model, mesh, args=args, annotations=ann, data_parallel=dp)
