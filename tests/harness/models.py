"""Small models for tests (no downloads): MLP stacks, the package's GPT, a pipeline net with
skips; their annotations, example batches, and the one GPT plan factory.

    >>> plan = gpt_plan("dp2xtp2")          # small GPT, Megatron on tp, batch split on dp
    >>> plan.check(*gpt_batch())
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from tests.harness.meshes import MESHES, MeshSpec

MEGATRON = {
    "blocks.*.attn.qkv": ap.colwise("tp"),
    "blocks.*.attn.proj": ap.rowwise("tp"),
    "blocks.*.mlp.fc": ap.colwise("tp"),
    "blocks.*.mlp.proj": ap.rowwise("tp"),
}
# the GPT's word embedding and (tied) LM head split by vocabulary; the loss never gathers a row
GPT_VOCAB = {"wte": ap.vocab_parallel("tp"), "lm_head": ap.vocab_parallel("tp")}
# Megatron's sequence parallel: the residual stream (norms, row-parallel outputs, embedding
# output) split on the sequence dim, gathered before each column-parallel layer
GPT_SEQUENCE_PARALLEL = {
    "blocks.*.attn.qkv": ap.colwise("tp"),
    "blocks.*.attn.proj": ap.rowwise("tp", output=ap.Shard(1)),
    "blocks.*.mlp.fc": ap.colwise("tp"),
    "blocks.*.mlp.proj": ap.rowwise("tp", output=ap.Shard(1)),
    "blocks.*.ln_*": ap.sequence_parallel("tp"),
    "ln_f": ap.sequence_parallel("tp"),
    "wte": ap.vocab_parallel("tp", output=ap.Shard(1)),
    "lm_head": ap.vocab_parallel("tp"),
}


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, layers=2, bias=True):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"fc1": nn.Linear(d, hidden, bias=bias), "fc2": nn.Linear(hidden, d, bias=bias)})
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["fc2"](F.relu(layer["fc1"](x)))
        return self.norm(x)


MLP_TP = {"layers.*.fc1": ap.colwise("tp"), "layers.*.fc2": ap.rowwise("tp")}


def small_gpt(tied=True, layers=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=4, n_embd=32, tied=tied))


class NanoGPTLoss(nn.Module):
    """The package's GPT with nanoGPT's own loss: ``targets.view(-1)`` needs a contiguous
    targets tensor (a sequence-split piece must be one)."""

    def __init__(self, seed=0):
        super().__init__()
        self.gpt = small_gpt(seed=seed)

    def forward(self, idx, targets):
        logits = self.gpt(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def gpt_batch(batch=8, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def gpt_plan(
    mesh: str | MeshSpec = "tp2", *, model=None, layers=2, tied=True, annotations=MEGATRON, batch=None, **plan_kw
):
    """The GPT planned on a named mesh: ``annotations`` (Megatron) where the mesh has a tp axis,
    the batch split on its dp axis. The model is ``plan.model``; other ap.plan options pass through."""
    spec = MESHES[mesh] if isinstance(mesh, str) else mesh
    model = small_gpt(layers=layers, tied=tied) if model is None else model
    ann = annotations if "tp" in spec.axes else {}
    return ap.plan(
        model,
        spec.mesh(),
        args=gpt_batch() if batch is None else batch,
        annotations=ann,
        data_parallel=spec.dp,
        **plan_kw,
    )


@lru_cache(maxsize=None)
def shared_gpt_plan(mesh: str = "dp2xtp2", annotated: bool = True):
    """gpt_plan built once per session, for tests that only read it (display, cost, save)."""
    return gpt_plan(mesh, annotations=MEGATRON if annotated else None)


class SkipNet(nn.Module):
    """Four blocks; block 0's output skips to blocks 2 and 3, a bool mask crosses to block 2,
    and block 1 hands two tensors to block 2 (multi-tensor pipeline boundaries)."""

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


def skipnet_plan(**pipeline_options):
    """SkipNet in 4 pipeline stages (1F1B, 2 micro-batches, mse loss), with its batch (x, y)."""
    torch.manual_seed(0)
    model = SkipNet()
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    options = dict(microbatches=2, schedule="1f1b", loss=mse) | pipeline_options
    plan = ap.plan(
        model, ap.Mesh((4,), ("pp",)), args=(x,), annotations=SKIP_SPLITS, pipeline=ap.Pipeline("pp", **options)
    )
    return plan, x, y
