"""Train the GPT-style model on a (dp, tp) mesh with real torch.distributed (gloo on CPU).

    torchrun --nproc-per-node 4 examples/train_gpt.py            # mesh (2, 2): dp x tp
    torchrun --nproc-per-node 2 examples/train_gpt.py --mesh 1,2 # tensor parallel only

Rank 0 also trains the serial model on the same global batches and prints both loss curves.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig

MEGATRON = {
    "blocks.*.attn.qkv": ap.colwise("tp"),
    "blocks.*.attn.proj": ap.rowwise("tp"),
    "blocks.*.mlp.fc": ap.colwise("tp"),
    "blocks.*.mlp.proj": ap.rowwise("tp"),
}


def batches(steps, batch, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield data[:, :-1], data[:, 1:]


def main():
    ap_ = argparse.ArgumentParser()
    ap_.add_argument("--mesh", default="2,2", help="dp,tp sizes (product = number of processes)")
    ap_.add_argument("--steps", type=int, default=20)
    ap_.add_argument("--lr", type=float, default=3e-3)
    args = ap_.parse_args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    dp, tp = (int(s) for s in args.mesh.split(","))
    mesh = ap.Mesh((dp, tp), ("dp", "tp"))
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    serial = GPT(cfg) if rank == 0 else None
    if serial is not None:
        serial.load_state_dict(model.state_dict())
    example = next(batches(1, 8, 16, cfg.vocab_size))
    module = ap.parallelize(model, mesh, args=example, annotations=MEGATRON, data_parallel="dp")
    plan = module.autopar_plan
    if rank == 0:
        print(plan.summary())
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    sopt = torch.optim.AdamW(serial.parameters(), lr=args.lr) if serial is not None else None
    for step, (x, y) in enumerate(batches(args.steps, 8, 16, cfg.vocab_size, seed=1)):
        a, k = plan.local_inputs(rank, x, y)
        _, loss = module(*a, **k)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if serial is not None:
            _, sloss = serial(x, y)
            sloss.backward()
            sopt.step()
            sopt.zero_grad()
            print(
                f"step {step:3d}  autopar loss {loss.item():.6f}  serial loss {sloss.item():.6f}  "
                f"diff {abs(loss.item() - sloss.item()):.2e}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
