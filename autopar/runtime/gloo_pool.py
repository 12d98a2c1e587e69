"""A pool of gloo worker processes on loopback, started once and reused for many jobs.

Starting processes costs seconds each on a small machine, so tests and benchmarks start a
pool once per session and send it jobs: a function named ``"package.module:function"``
(importable in the workers) and its picklable arguments. Every worker runs the job as its
rank of an initialised gloo process group and sends back its return value. A job that
raises on any rank, or takes longer than ``timeout`` seconds, fails naming the rank; after
a timeout the pool is torn down (a rank may be stuck in a collective) and restarted on the
next job.

Example:
    >>> with GlooPool(world_size=2) as pool:
    ...     results = pool.run("tests.gloo.jobs:gpt_step_matches_serial", (2, 2), ("dp", "tp"), "dp")
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import time
import socket
import sys
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent: int, every: float = 1.0) -> None:
    """Exit this worker once its parent is gone. A parent killed by a signal (a test run stopped
    with Ctrl-C twice, a CI timeout) runs no clean-up, so its daemon workers would outlive it:
    blocked on the job queue forever, or spinning in a collective whose peers died."""
    import threading

    def watch():
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, name="autopar-parent-watch", daemon=True).start()


def _worker(rank: int, world: int, port: int, jobs, results, paths, pg_timeout: float, parent: int) -> None:
    """One rank: join the group through the store the parent serves on ``port``, then run jobs."""
    _exit_with_parent(parent)
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
        RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    while True:
        job = jobs.get()
        if job is None:
            break
        target, args, kwargs = job
        try:
            module, name = target.split(":")
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - sent back to the parent with the rank
            from autopar.runtime.failures import report_failure

            report_failure(rank, e)  # so that ranks waiting on this one can say who failed
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class JobError(RuntimeError):
    """A job failed on some rank of a GlooPool (or timed out)."""


class GlooPool:
    def __init__(self, world_size: int, timeout: float = 180.0, pg_timeout: float = 60.0):
        self.world_size, self.timeout, self.pg_timeout = world_size, timeout, pg_timeout
        self.procs: list = []
        self.store = None  # the c10d TCPStore this process serves to the workers (start())

    def start(self) -> "GlooPool":
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # The parent serves the group's store on a port the OS picks as it binds (port 0): pools
        # started at once (pytest-xdist workers, other test runs on the machine) cannot collide,
        # as they could on a port probed free first and bound by rank 0 later.
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.pg_timeout)
        )
        port = self.store.port
        self.jobs = [ctx.Queue() for _ in range(self.world_size)]
        self.results = ctx.Queue()
        paths = [p for p in sys.path if p]
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                name=f"gloo-rank{r}",
                args=(r, self.world_size, port, self.jobs[r], self.results, paths, self.pg_timeout, os.getpid()),
            )
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()
        return self

    def run(self, target: str, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``target(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self.start()
        for q in self.jobs:
            q.put((target, args, kwargs))
        return self._collect(target, timeout or self.timeout)

    def _collect(self, target: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        out: dict[int, object] = {}
        failures: dict[int, str] = {}
        dead: list[int] = []
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                waiting = set(range(self.world_size)) - set(out) - set(failures) - set(dead)
                if waiting and time.monotonic() < deadline:
                    continue  # the live ranks report how a dead one affected them (or time out)
                self._restart()
                missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
                detail = "".join(f"\n--- rank {r} ---\n{m}" for r, m in failures.items())
                why = f"rank processes {dead} died" if dead else f"no result within {timeout:.0f} s"
                raise JobError(f"{target}: ranks {missing} gave no result ({why}).{detail}") from None
            (out if ok else failures)[rank] = payload
        if failures:
            self._restart()  # a failed job may leave collectives half-done: start afresh
            r = min(failures)
            raise JobError(f"{target} failed on rank {r}:\n{failures[r]}")
        return [out[r] for r in range(self.world_size)]

    def _restart(self) -> None:
        """After a failed job: replace the workers now (they boot while the caller goes on)."""
        self.close(grace=1.0)
        self.start()

    def close(self, grace: float = 2.0) -> None:
        for q in getattr(self, "jobs", []):
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
        self.procs = []
        self.store = None  # its server stops with the workers it served

    def __enter__(self) -> "GlooPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
