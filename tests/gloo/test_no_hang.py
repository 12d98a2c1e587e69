"""No hangs on real processes: failed or dead ranks make the others fail fast, naming them; the
pool recovers; debug=True catches ranks holding different plans (simulated: unit/test_simulator.py)."""

from __future__ import annotations

import time

import pytest

from autopar.runtime.gloo_pool import JobError


def test_world_size_and_debug_consistency(gloo):
    for out in gloo(2).run("tests.gloo.jobs_failures:debug_checks", timeout=90):
        assert "2 processes" in out["mesh"] and "4 ranks" in out["mesh"] and "nproc-per-node 4" in out["mesh"]
        assert "ranks disagree on the plan" in out["mismatch"], out["mismatch"]
        assert "first differing collective over ranks (0, 1): #0" in out["mismatch"], out["mismatch"]
        assert out["consistent"] == (4, 8)


def test_real_run_rank_dies(gloo):
    pool = gloo(2)
    with pytest.raises(JobError) as info:
        pool.run("tests.gloo.jobs_failures:one_rank_fails", "exit", 2.0, timeout=60)
    text = str(info.value)
    assert "rank processes [1] died" in text, text
    assert "rank 0: all_reduce over ranks (0, 1) failed" in text and "one of ranks [1] died" in text, text


def test_real_run_rank_raises_before_collective(gloo):
    pool = gloo(2)
    assert pool.run("tests.gloo.jobs:world_info") == [(0, 2), (1, 2)]  # recovered from the dead rank
    start = time.monotonic()
    with pytest.raises(JobError) as info:
        pool.run("tests.gloo.jobs_failures:one_rank_fails", "raise", 2.0, timeout=60)
    text = str(info.value)
    assert "rank 0: all_reduce over ranks (0, 1) failed" in text, text
    assert "rank 1 failed: ValueError: boom on rank 1" in text, text
    assert time.monotonic() - start < 45


def test_workers_exit_when_their_parent_is_killed(tmp_path):
    """A process holding a pool dies by SIGKILL (no clean-up runs): its workers notice and exit
    within seconds instead of outliving it."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "hold_pool.py"
    script.write_text(
        "import time\n"
        "from autopar.runtime.gloo_pool import GlooPool\n"
        "if __name__ == '__main__':\n"  # the workers are spawned: they import this file
        "    pool = GlooPool(2).start()\n"
        "    pool.run('os:getpid')\n"  # the workers are up
        "    print(' '.join(str(p.pid) for p in pool.procs), flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in holder.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:  # an exited child not yet reaped is a zombie
            return f.read().split(") ")[1][0] != "Z"

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]


def test_pool_starts_when_a_probed_port_is_taken(monkeypatch):
    """Pools started at once (one per pytest-xdist worker, other runs on the machine) must not race for
    a port: the store binds its own (port 0), so a port probed free and taken since changes nothing."""
    import socket

    from autopar.runtime import gloo_pool

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(gloo_pool, "free_port", lambda: taken.getsockname()[1])
        with gloo_pool.GlooPool(2, timeout=60) as pool:
            assert pool.run("tests.gloo.jobs:world_info") == [(0, 2), (1, 2)]
