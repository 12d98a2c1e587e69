"""Run a fault-tolerant job of several replica groups (each its own gloo world of 2 processes,
jobs_fault_tolerant.py), SIGKILL one group's process mid-run and restart that group as torchrun
would, and rebuild the serial run over the committed batches (test_fault_tolerant.py and
bench/bench_fault_tolerance.py share it).

The serial reference is data parallel's with a batch norm: each rank's rows go through the
model apart (its own batch statistics), the gradient is the mean over the ranks taking part of
their own means, and the running statistics are those of the first rank of the first group
taking part (the one whose buffers every group receives).

Example:
    >>> run = run_job(tmp_path, "tp", steps=12, groups=2, kill_at=4)
    >>> max_difference(run)       # every rank's final pieces vs the serial run's
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from autopar.parallel.fault_tolerant import start_lighthouse
from autopar.runtime.gloo_pool import free_port
from tests.gloo import jobs_fault_tolerant as jobs

RANKS = 2  # processes per replica group


def _start_group(out: Path, kind: str, steps: int, groups: int, replica: int, lighthouse: str, env_extra=None):
    """One replica group's job: RANKS processes of jobs_fault_tolerant in a gloo world of their own."""
    port, procs = free_port(), []
    for r in range(RANKS):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(REPLICA_GROUP_ID=str(replica), TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1")
        env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.getcwd(), RUST_LOG="error", **(env_extra or {}))
        cmd = [sys.executable, "-m", "tests.gloo.jobs_fault_tolerant", str(out), kind, str(steps), str(groups)]
        path = out / f"stderr_{replica}_{r}_{time.time():.0f}.txt"
        with open(path, "w") as err:
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err))
        procs[-1].stderr_path = path
    return procs


def _maybe_stop(out: Path, victim: int, groups: int, since: float | None, after: int) -> None:
    """Once the victim group (restarted, if it was killed) has taken part in a step with every
    group, tell the jobs to stop ``after`` steps later (the file jobs_fault_tolerant reads)."""
    stop = out / "stop"
    if since is None or stop.exists():
        return
    log = [r for r in read_log(out, victim) if r["t"] > since]  # since its restart
    joint = [r["step"] for r in log if r.get("committed") and r["part"] and r["n"] == groups]
    if joint:
        tmp = out / "stop.tmp"
        tmp.write_text(str(max(joint) + after))
        tmp.rename(stop)


def read_log(out: Path, replica: int) -> list[dict]:
    path = out / f"log_{replica}_0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_job(
    out: Path,
    kind: str,
    steps: int,
    groups: int,
    kill_at: int | None = None,
    timeout: float = 120.0,
    victim: int | None = None,
    env: dict | None = None,
    after: int = 3,
    lose_lighthouse: bool = False,
):
    """Run the job; with ``kill_at`` the ``victim`` group's (default: the last) rank 1 is
    SIGKILLed once ``kill_at`` steps with every group in them committed, and the group restarted.
    The jobs stop ``after`` steps after the victim's first step with every group (since its
    restart). ``env``: more environment for every process (FT_CKPT...). ``lose_lighthouse``: once
    every rank saved its state the ranks go on stepping and the lighthouse is SIGKILLed; the
    result's ``lighthouse`` says how they ended (exit codes, seconds from the kill, stderr).
    Returns a dict of what happened."""
    size = groups * RANKS
    out.mkdir(parents=True, exist_ok=True)
    lighthouse = start_lighthouse(1, join_timeout_ms=500, heartbeat_timeout_ms=1000, log=subprocess.DEVNULL)
    victim = groups - 1 if victim is None else victim
    killed_at, restarted_at = None, None

    env = {**(env or {}), **({"FT_LOSE_LIGHTHOUSE": "1", "FT_QUORUM_TIMEOUT": "5"} if lose_lighthouse else {})}
    lost_at = None

    def start(g):
        return _start_group(out, kind, steps, groups, g, lighthouse.address, env)

    try:
        running = {g: start(g) for g in range(groups)}
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for procs in running.values() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault-tolerant job did not finish in {timeout} s; logs in {out}")
            if kill_at is not None and killed_at is None:
                # after kill_at steps every group took part in (groups start at different times)
                if sum(r.get("committed", False) and r["n"] == groups for r in read_log(out, victim)) >= kill_at:
                    running[victim][1].send_signal(signal.SIGKILL)
                    killed_at = time.time()
            if killed_at is not None and restarted_at is None and running[victim][1].poll() is not None:
                for p in running[victim]:  # torchrun's restart: the whole group goes, and comes back
                    p.kill()
                    p.wait()
                running[victim] = start(victim)
                restarted_at = time.time()
            _maybe_stop(out, victim, groups, 0.0 if kill_at is None else restarted_at, after)
            if lose_lighthouse and lost_at is None and all((out / f"state_{r}.pt").exists() for r in range(size)):
                lighthouse.stop()
                lost_at = time.monotonic()
            for g, procs in running.items():
                if lost_at is not None:
                    break
                bad = [p.returncode for p in procs if p.poll() not in (None, 0)]
                if bad and not (g == victim and killed_at is not None and restarted_at is None):
                    raise RuntimeError(f"replica group {g} failed (exit {bad}); logs in {out}")
            time.sleep(0.05)
    finally:
        for procs in running.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        lighthouse.stop()
    run = dict(out=out, kind=kind, groups=groups, victim=victim, killed_at=killed_at, restarted_at=restarted_at)
    if lose_lighthouse:
        procs = [p for g in sorted(running) for p in running[g]]
        run["lighthouse"] = dict(
            codes=[p.returncode for p in procs],
            seconds=time.monotonic() - lost_at,
            stderr=[p.stderr_path.read_text() for p in procs],
        )
    return run


def committed_steps(out: Path, groups: int) -> dict[int, list[int]]:
    """Committed step -> the replica groups whose gradients it averaged (their logs must agree
    on how many took part)."""
    steps: dict[int, list[int]] = {}
    counts: dict[int, set] = {}
    for g in range(groups):
        for r in read_log(out, g):
            if r.get("committed") and r["part"]:
                counts.setdefault(r["step"], set()).add(r["n"])
                steps.setdefault(r["step"], []).append(g)
    for s, groups_in in steps.items():
        assert counts[s] == {len(groups_in)}, f"step {s}: groups {groups_in} took part but logs say {counts[s]}"
    return dict(sorted(steps.items()))


def first_groups(out: Path, groups: int) -> dict[int, int]:
    """Committed step -> the first group taking part (whose buffers every group received)."""
    firsts: dict[int, list[int]] = {}
    for g in range(groups):
        for r in read_log(out, g):
            if r.get("first"):
                firsts.setdefault(r["step"], []).append(g)
    assert all(len(f) == 1 for f in firsts.values()), f"steps with several first groups: {firsts}"
    return {s: f[0] for s, f in firsts.items()}


def resumed_at(out: Path, groups: int) -> int:
    """The checkpoint step every group of a restarted job resumed from."""
    at = {r["resumed"] for g in range(groups) for r in read_log(out, g) if "resumed" in r}
    assert len(at) == 1, f"the groups resumed from {at}"
    return at.pop()


def history(run: dict) -> tuple[dict, dict, dict]:
    """(committed steps, first groups, mesh kind) by step, of the run and of the run it resumed
    from before its checkpoint (``run["before"]``: that run's dict)."""
    out, groups = run["out"], run["groups"]
    steps, firsts = committed_steps(out, groups), first_groups(out, groups)
    kinds = dict.fromkeys(steps, run["kind"])
    before = run.get("before")
    if before is not None:
        c = resumed_at(out, groups)
        old_steps, old_firsts = committed_steps(before["out"], groups), first_groups(before["out"], groups)
        steps = {**{s: g for s, g in old_steps.items() if s < c}, **steps}
        firsts = {**{s: g for s, g in old_firsts.items() if s < c}, **firsts}
        kinds = {**{s: before["kind"] for s in old_steps if s < c}, **kinds}
    return dict(sorted(steps.items())), firsts, kinds


def serial_reference(steps: dict[int, list[int]], firsts: dict[int, int], kinds: dict[int, str], groups: int):
    """The serial model trained on each committed step's batches of the groups that took part,
    as data parallel computes it (module docstring)."""
    model = jobs.model()
    opt = jobs.optimizer(model.parameters())
    assert list(steps) == list(range(len(steps))), f"committed steps are not 0..n-1 each once: {list(steps)}"
    for s, groups_in in steps.items():
        x, y = jobs.batch(s, groups)
        per_rank = jobs.ROWS // (RANKS if kinds[s] == "hsdp" else 1)  # HSDP splits a group's rows over its ranks
        order = sorted(groups_in, key=lambda g: g != firsts[s])  # the first group's first rank first
        chunks = [
            torch.arange(a, a + per_rank) for g in order for a in range(g * jobs.ROWS, (g + 1) * jobs.ROWS, per_rank)
        ]
        opt.zero_grad()
        for i, rows in enumerate(chunks):
            (((model(x[rows]) - y[rows]) ** 2).mean() / len(chunks)).backward()
            if i == 0:
                kept = {n: b.clone() for n, b in model.named_buffers()}
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(kept[n])
        opt.step()
    return model


def reference(run: dict, upto: int | None = None):
    """The serial reference of ``run`` (its first ``upto`` committed steps)."""
    steps, firsts, kinds = history(run)
    if upto is not None:
        steps = {s: g for s, g in steps.items() if s < upto}
    return serial_reference(steps, firsts, kinds, run["groups"])


def difference(run: dict, ref, prefix: str = "state") -> float:
    """Largest |piece - ref's piece| over the files ``prefix_<rank>.pt`` the run's ranks wrote
    (the batch norm's running statistics and counter included)."""
    import autopar as ap

    out, groups = run["out"], run["groups"]
    mesh, kw = jobs.setup(run["kind"], groups)
    x0, _ = jobs.batch(0, groups)
    plan = ap.plan(jobs.model(), mesh, args=(x0,), fault_tolerant="dp", **kw)
    worst, seen = 0.0, 0
    for rank in range(mesh.size):
        if not (out / f"{prefix}_{rank}.pt").exists():
            continue
        seen += 1
        mine = torch.load(out / f"{prefix}_{rank}.pt")
        want = plan.shard_state_dict(ref.state_dict(), rank)
        assert set(mine) == set(want), (sorted(mine), sorted(want))
        worst = max(worst, *((mine[k] - want[k]).abs().max().item() for k in want if want[k].numel()))
    assert seen, f"no {prefix}_*.pt in {out}"
    return worst


def max_difference(run: dict) -> float:
    """Largest |final piece - serial reference's piece| over every rank of every group."""
    return difference(run, reference(run))


def recovery(run: dict) -> dict:
    """Steps lost and seconds to recover around the kill: attempts that did not commit on the
    survivors, the longest gap between their commits, and from the restart to the killed group's
    first step taking part again."""
    out, victim = run["out"], run["victim"]
    survivor = [r for r in read_log(out, 1 if victim == 0 else 0) if "committed" in r]
    lost = sum(not r["committed"] for r in survivor)
    times = [r["t"] for r in survivor if r["committed"]]
    stall = max(b - a for a, b in zip(times, times[1:]))
    back = [r["t"] for r in read_log(out, victim) if r["t"] > (run["restarted_at"] or 0) and r.get("part")]
    rejoin = (back[0] - run["killed_at"]) if back and run["killed_at"] else None
    return dict(steps_lost=lost, survivor_stall_s=stall, rejoin_s=rejoin)
