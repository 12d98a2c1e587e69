"""One rank of one replica group's job under ap.FaultTolerant (run as ``python -m`` by
test_fault_tolerant.py and bench/bench_fault_tolerance.py; each group is its own gloo world).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (this group's store), REPLICA_GROUP_ID,
TORCHFT_LIGHTHOUSE; FT_CKPT (a folder of DCP checkpoints), FT_CKPT_EVERY (save one every that many
committed steps, from the group ft.saves_checkpoint() names; only steps every group took part in,
so a killed group resumes from one older than its peers' step and heals), FT_RESUME (load the
latest one there before the first step, as a restarted job would), FT_LOSE_LIGHTHOUSE (once done,
go on stepping until the lighthouse is gone: the run ends with its error), FT_QUORUM_TIMEOUT. Arguments: out folder, mesh kind ("tp" or
"hsdp"), steps, groups.

The model has a batch norm: its running statistics are written by every training forward and
broadcast from the first group taking part in the step. Each step's batch is drawn from the job's
committed step count (``ft.step``), so a retried step reuses its batch and a healed group takes
its peers' next one. The group's rank 0 writes one JSON line per attempt (step, taking part,
participants, committed, whether it was the first group taking part, time) and one when it
resumed from a checkpoint; every rank saves its local state at the end. The loop stops at the
first step with every group in it at or after both ``steps`` and the step the driver writes into
OUT/stop (once the killed group is back), so no group is left stepping alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar as ap

ROWS = 8  # rows per replica group per step (4 per rank under HSDP: a batch norm over 2 rows is chaotic)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
    )


def batch(step: int, groups: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS * groups, 8, generator=g), torch.randn(ROWS * groups, 4, generator=g)


def setup(kind: str, groups: int):
    if kind == "tp":
        mesh = ap.Mesh((groups, 2), ("dp", "tp"))
        kw = dict(annotations={"0": ap.colwise("tp"), "3": ap.rowwise("tp")})
    else:  # HSDP: zero=3 inside each group of 2, fault-tolerant replication across groups
        mesh = ap.Mesh((groups, 2), ("dp", "shard"))
        kw = dict(data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="dp"))
    return mesh, kw


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: optimizer state a healer must fetch


def _stop_at(out: str) -> float:
    """The step the driver said to stop at (file ``stop``; none yet: never). Every group stops at
    the first step at or after it that all groups committed, so none is left alone."""
    path = os.path.join(out, "stop")
    return int(open(path).read()) if os.path.exists(path) and os.path.getsize(path) else float("inf")


def _latest(folder: str) -> str | None:
    """The newest complete checkpoint in ``folder`` (rank 0's choice, given to the group's others:
    one may be written meanwhile)."""
    done = [d for d in os.listdir(folder) if d.startswith("step_") and "." not in d] if os.path.isdir(folder) else []
    pick = [os.path.join(folder, max(done, key=lambda d: int(d[5:])))] if done else [None]
    dist.broadcast_object_list(pick, src=0)
    return pick[0]


def save(module, opt, job, folder: str) -> None:
    """A DCP checkpoint of the step just committed (this group's ranks together), renamed into
    place once complete."""
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    path = os.path.join(folder, f"step_{job.step}")
    dcp.save({"model": model_sd, "optim": optim_sd, "ft": job.state_dict()}, checkpoint_id=path + ".tmp")
    if dist.get_rank() == 0:
        os.rename(path + ".tmp", path)


def resume(module, opt, job, path: str) -> None:
    model_sd, optim_sd = ap.get_state_dict(module, opt)
    state = {"model": model_sd, "optim": optim_sd, "ft": job.state_dict()}
    dcp.load(state, checkpoint_id=path)
    ap.set_state_dict(module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.load_state_dict(state["ft"])


def main(out: str, kind: str, steps: int, groups: int) -> None:
    dist.init_process_group("gloo")
    mesh, kw = setup(kind, groups)
    x0, _ = batch(0, groups)
    ft = ap.FaultTolerant("dp", timeout=10, quorum_timeout=float(os.environ.get("FT_QUORUM_TIMEOUT", 30)))
    module = ap.parallelize(model(), mesh, args=(x0,), fault_tolerant=ft, timeout=20, **kw)
    plan, job = module.autopar_plan, module.autopar_fault_tolerant
    rank = mesh.size // groups * job.replica + dist.get_rank()
    opt = job.wrap(optimizer(module.parameters()))
    log = open(os.path.join(out, f"log_{job.replica}_{dist.get_rank()}.jsonl"), "a")
    folder, every = os.environ.get("FT_CKPT"), int(os.environ.get("FT_CKPT_EVERY", 0))
    if folder and os.environ.get("FT_RESUME") and (path := _latest(folder)):
        resume(module, opt, job, path)
        log.write(json.dumps(dict(resumed=job.step, path=path, t=time.time())) + "\n")
        loaded = {k: v.detach().clone() for k, v in module.state_dict().items()}
        torch.save(loaded, os.path.join(out, f"resumed_{rank}.pt"))  # before any heal replaces it
    lose = bool(os.environ.get("FT_LOSE_LIGHTHOUSE"))
    while True:
        opt.zero_grad()
        step = job.step
        x, y = batch(step, groups)
        (lx,), _ = plan.local_inputs(rank, x)
        (ly,), _ = plan.local_inputs(rank, y)
        loss = ((module(lx) - ly) ** 2).mean()
        loss.backward()
        part, n = job.participating(), job.participants()
        committed = opt.step()
        if os.path.exists(os.path.join(out, f"state_{rank}.pt")):
            continue  # done, training on until the lighthouse is gone (FT_LOSE_LIGHTHOUSE): no record
        done = job.step - 1 if committed else job.step  # a healed group's step is its peers' (not `step`)
        first = committed and job.saves_checkpoint()  # its buffers went to every group
        if first and every and job.step % every == 0 and n == groups:
            save(module, opt, job, folder)
        record = dict(step=done, part=part, n=n, committed=committed, first=first, t=time.time(), pid=os.getpid())
        log.write(json.dumps(record) + "\n")
        log.flush()
        if committed and n == groups and job.step >= max(steps, _stop_at(out)):
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            torch.save(state, os.path.join(out, f"state_{rank}.pt.tmp"))
            os.rename(os.path.join(out, f"state_{rank}.pt.tmp"), os.path.join(out, f"state_{rank}.pt"))
            if not lose:
                break
        time.sleep(0.05)  # a step of a real model takes a while: leave the failure a window
    dist.barrier()
    job.manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
