"""train_lm.py --fault-tolerant: the LLaMA-style model trained by replica groups that survive a lost one.

    python examples/train_lm.py --fault-tolerant --mesh dp=2,tp=2 --steps 40 --out runs/ft
    python examples/train_lm.py --fault-tolerant --mesh dp=2,tp=2 --steps 40 --out runs/ft --kill-at 10

Run it with plain ``python`` (not torchrun): this launcher starts the torchft lighthouse, then one
job of |tp| x ... processes per position of ``dp`` (a replica group, ``REPLICA_GROUP_ID``), and
restarts a group whose process dies, as torchrun --max-restarts would. ``--kill-at N`` SIGKILLs
the last group's last process after N steps committed by all groups to show it: the other groups keep stepping, the
killed group comes back, loads the latest checkpoint, fetches the weights and AdamW state from a
live one (further on) and rejoins. Each group's rank 0 writes OUT/ft_metrics.jsonl (step, loss,
groups taking part, committed). The batch of each step is read at the job's committed step
count, so every committed batch is used once. Every ``--ckpt-every`` committed steps the first
group taking part writes a DCP checkpoint, OUT/ckpt/ft_step_N (model, AdamW, the job's step); a
group starting where one exists resumes from the newest (all of them, when the whole run is
started again on the same OUT). See docs/fault_tolerance.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar as ap
from autopar.parallel.fault_tolerant import start_lighthouse
from lm_data import TokenLoader
from lm_model import LlamaLM, llama_config, megatron

MAX_RESTARTS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(argv: list, group: int, size: int, lighthouse: str) -> list:
    port, procs = _port(), []
    for r in range(size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(REPLICA_GROUP_ID=str(group), TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1", RUST_LOG="error")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return procs


def launch(args, argv: list, shape: tuple, names: tuple) -> int:
    """The parent: lighthouse, one job per replica group, restarts; returns when all groups end."""
    groups, size = shape[names.index("dp")], 1
    for n in shape:
        size *= n
    size //= groups
    os.makedirs(args.out, exist_ok=True)
    lighthouse = start_lighthouse(min_replicas=1, log=open(os.path.join(args.out, "lighthouse.log"), "w"))
    print(f"lighthouse at {lighthouse.address}; {groups} replica groups of {size} processes", flush=True)
    jobs = {g: _start_group(argv, g, size, lighthouse.address) for g in range(groups)}
    restarts, killed = 0, args.kill_at is None
    try:
        while any(p.poll() is None for procs in jobs.values() for p in procs):
            if not killed and _committed(args.out, groups) >= args.kill_at:
                jobs[groups - 1][-1].send_signal(signal.SIGKILL)
                print(f"killed a process of replica group {groups - 1}", flush=True)
                killed = True
            for g, procs in jobs.items():
                if any(p.poll() not in (None, 0) for p in procs):
                    if restarts == MAX_RESTARTS:
                        raise SystemExit(f"replica group {g} failed {MAX_RESTARTS + 1} times; see its output")
                    for p in procs:
                        p.kill()
                        p.wait()
                    restarts += 1
                    print(f"restarting replica group {g}", flush=True)
                    jobs[g] = _start_group(argv, g, size, lighthouse.address)
            time.sleep(0.1)
    finally:
        for procs in jobs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        lighthouse.stop()
    return 0


def _committed(out: str, groups: int) -> int:
    """Steps committed with every group in them, as the groups' rank 0 logged them."""
    path = os.path.join(out, "ft_metrics.jsonl")
    if not os.path.exists(path):
        return 0
    rows = [json.loads(line) for line in open(path).read().splitlines() if line.endswith("}")]
    return sum(r["committed"] and r["groups"] == groups and r["group"] == 0 for r in rows)


def worker(args, run: dict, shape: tuple, names: tuple, blob: dict) -> None:
    """One rank of one replica group's job."""
    mesh = ap.Mesh(shape, names)
    groups = shape[names.index("dp")]
    torch.manual_seed(0)  # the same start everywhere (torchft also syncs it from a live group)
    cfg = llama_config(run["vocab"], run["hidden"], run["layers"], run["heads"], run["kv_heads"], run["seq"])
    loader = TokenLoader(blob["train"], run["batch"], run["seq"])
    x, y = loader.next()
    kw = {"annotations": megatron("tp")} if "tp" in names else {}
    ft = ap.FaultTolerant("dp", timeout=60, quorum_timeout=60)
    # the logits, and the loss taken here: a loss inside the model would average over dp in the forward,
    # across replica groups (ap.FaultTolerant refuses it); each group's own mean is what torchft averages
    module = ap.parallelize(LlamaLM(cfg), mesh, args=(x,), fault_tolerant=ft, timeout=args.timeout, **kw)
    plan, job = module.autopar_plan, module.autopar_fault_tolerant
    rank = mesh.size // groups * job.replica + dist.get_rank()
    opt = job.wrap(torch.optim.AdamW(module.parameters(), lr=run["lr"]))
    folder = os.path.join(args.out, "ckpt")
    latest = _latest(folder)
    if latest is not None:  # a restarted group: it heals from the live ones if they are further on
        _load(latest, module, opt, job)
        print(f"group {job.replica} resumed from {latest} at step {job.step}", flush=True)
    span = run["batch"] * run["seq"]
    metrics = open(os.path.join(args.out, "ft_metrics.jsonl"), "a") if dist.get_rank() == 0 else None
    while True:
        opt.zero_grad()
        loader.load_state_dict({"pos": job.step * span % (blob["train"].numel() - span - 1), "epoch": 0})
        x, y = loader.next()
        (lx,), _ = plan.local_inputs(rank, x)  # this rank's rows (its group's share of the batch)
        (ly,), _ = plan.local_inputs(rank, y)  # the same rows of the targets
        logits = module(lx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ly.reshape(-1))
        loss.backward()
        n, committed = job.participants(), opt.step()
        if metrics is not None:
            row = dict(group=job.replica, step=job.step, loss=round(loss.item(), 4), groups=n, committed=committed)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            print(f"group {job.replica} step {job.step:4d} loss {loss.item():.4f} groups {n}", flush=True)
        if committed and args.ckpt_every and job.step % args.ckpt_every == 0 and job.saves_checkpoint():
            _save(folder, module, opt, job)
        if committed and job.step >= args.steps and n == groups:
            break
    dist.barrier()
    job.manager.shutdown(wait=False)


def _latest(folder: str) -> str | None:
    """The newest complete checkpoint (rank 0's pick, given to the group's others: a live group
    may complete another meanwhile)."""
    done = [d for d in os.listdir(folder) if d.startswith("ft_step_") and "." not in d] if os.path.isdir(folder) else []
    pick = [os.path.join(folder, max(done, key=lambda d: int(d[8:])))] if done else [None]
    dist.broadcast_object_list(pick, src=0)
    return pick[0]


def _save(folder: str, module, opt, job) -> None:
    """This group's ranks write the checkpoint together (each group's pieces are the same global
    tensors, described on its own DeviceMesh); renamed into place once complete."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = ap.get_state_dict(module, opt)
    path = os.path.join(folder, f"ft_step_{job.step}")
    dcp.save({"model": model_sd, "optim": optim_sd, "ft": job.state_dict()}, checkpoint_id=path + ".tmp")
    if dist.get_rank() == 0:
        os.replace(path + ".tmp", path)


def _load(path: str, module, opt, job) -> None:
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = ap.get_state_dict(module, opt)
    state = {"model": model_sd, "optim": optim_sd, "ft": job.state_dict()}
    dcp.load(state, checkpoint_id=path)
    ap.set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.load_state_dict(state["ft"])  # before the first step: the lighthouse hears this step


if __name__ == "__main__":  # a worker, started by launch
    import train_lm

    sys.exit(train_lm.main(sys.argv[1:]))
