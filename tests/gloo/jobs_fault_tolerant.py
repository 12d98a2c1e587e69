"""One rank of one replica group's job under ap.FaultTolerant (run as ``python -m`` by
test_fault_tolerant.py and bench/bench_fault_tolerance.py; each group is its own gloo world).

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (this group's store), REPLICA_GROUP_ID,
TORCHFT_LIGHTHOUSE. Arguments: out folder, mesh kind ("tp" or "hsdp"), steps, groups.

Each step's batch is drawn from the job's committed step count (``ft.step``), so a retried step
reuses its batch and a healed group takes its peers' next one. The group's rank 0 writes one JSON
line per attempt (step, taking part, participants, committed, time); every rank saves its local
state at the end. The loop stops at the first step with every group in it at or after both
``steps`` and the step the driver writes into OUT/stop (once the killed group is back), so no
group is left stepping alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import autopar as ap

ROWS = 4  # rows per replica group per step


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int, groups: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS * groups, 8, generator=g), torch.randn(ROWS * groups, 4, generator=g)


def setup(kind: str, groups: int):
    if kind == "tp":
        mesh = ap.Mesh((groups, 2), ("dp", "tp"))
        kw = dict(annotations={"0": ap.colwise("tp"), "2": ap.rowwise("tp")})
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
        done = job.step - 1 if committed else job.step  # a healed group's step is its peers' (not `step`)
        record = dict(step=done, part=part, n=n, committed=committed, t=time.time(), pid=os.getpid())
        log.write(json.dumps(record) + "\n")
        log.flush()
        if committed and n == groups and job.step >= max(steps, _stop_at(out)):
            break
        time.sleep(0.05)  # a step of a real model takes a while: leave the failure a window
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save(state, os.path.join(out, f"state_{rank}.pt"))
    dist.barrier()
    job.manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
