"""ap.FaultTolerant on real processes: replica groups of 2 gloo ranks each, one group's process
SIGKILLed mid-run (ft_driver.py). The survivors keep training without a restart, the killed group
restarts, loads the job's latest DCP checkpoint (written by the first group taking part), heals
from a live peer (parameters, SGD momentum, batch-norm statistics) and rejoins, and every rank's
final pieces equal the serial model trained on exactly the committed batches of the groups that
took part in each step, with data parallel's batch norm (each rank's rows normalised apart, the
running statistics of the first group taking part: ft_driver's docstring).

Tolerance: 1e-4 absolute on tensors of size ~0.3 to ~1 (running variances) after up to ~150 fp32
SGD steps with momentum (a survivor steps alone while the killed group restarts; the sums run in
another order than serial's; seen: 2e-6). The checkpoint a group resumed from is compared at
1e-5 (a few steps: seen 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.gloo import ft_driver
from tests.gloo import jobs_fault_tolerant as jobs

TOL = 1e-4


def _ckpt_env(out, every: int = 2) -> dict:
    return dict(FT_CKPT=str(out / "ckpt"), FT_CKPT_EVERY=str(every), FT_RESUME="1")


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """2 groups of 2 (dp x tp), group 1's rank 1 SIGKILLed after 3 joint steps; a checkpoint
    every 2 committed steps with every group in them; the restarted group resumes from the
    latest (before the kill: its peers stepped on meanwhile), then heals. Once every rank saved
    its final state, the ranks go on stepping and the lighthouse is SIGKILLed (quorum timeout
    5 s): one run of processes for all three tests, as each start costs seconds."""
    out = tmp_path_factory.mktemp("ft_killed")
    env = _ckpt_env(out)
    return ft_driver.run_job(out, "tp", steps=6, groups=2, kill_at=3, timeout=400, env=env, lose_lighthouse=True)


def _rejoined(run):
    steps = ft_driver.committed_steps(run["out"], run["groups"])
    assert ft_driver.max_difference(run) < TOL
    assert steps[max(steps)] == list(range(run["groups"])), steps  # the killed group took part at the end
    alone = [s for s, g in steps.items() if run["victim"] not in g and s > min(steps)]
    assert alone, f"the survivors never stepped without the killed group: {steps}"
    rec = ft_driver.recovery(run)
    assert rec["steps_lost"] <= 3 and rec["rejoin_s"] is not None, rec
    return steps


def test_kill_a_replica_group_survivors_train_and_it_rejoins(killed):
    _rejoined(killed)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process, on purpose
def test_restarted_group_resumed_from_the_checkpoint_then_healed(killed):
    """What the killed group loaded from the DCP checkpoint (the survivor's, on a group's own
    DeviceMesh) equals the serial model at that step; the peers were further on, so it healed
    (its first step after the restart did not take part); the checkpoint holds the serial
    tensors whole (read back in one process, as any other plan would)."""
    out, victim = killed["out"], killed["victim"]
    at = ft_driver.resumed_at(out, 2)
    ref = ft_driver.reference(killed, upto=at)
    assert ft_driver.difference(killed, ref, prefix="resumed") < 1e-5
    after = [r for r in ft_driver.read_log(out, victim) if r["t"] > killed["restarted_at"] and "committed" in r]
    assert not after[0]["part"] and after[0]["step"] > at, after[:2]  # behind its peers: healed
    _holds(out / "ckpt" / f"step_{at}", ref)


def _holds(path, ref) -> None:
    """The checkpoint at ``path``, read in this one process, holds ``ref``'s tensors whole."""
    state = {k: torch.zeros_like(v) for k, v in jobs.model().state_dict().items()}
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    for k, v in ref.state_dict().items():
        assert (state[k] - v).abs().max() < 1e-5, k


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_restart_every_group_from_the_checkpoint_with_another_plan(killed, tmp_path):
    """A new job (every group restarted, zero=3 inside each group now: another plan) loads the
    killed run's latest checkpoint, resumes at its step and trains on; its final pieces equal the
    serial run over the first run's committed steps before the checkpoint and its own after, and
    the checkpoints it writes hold the serial tensors."""
    folder = killed["out"] / "ckpt"
    env = dict(FT_CKPT=str(folder), FT_RESUME="1", FT_CKPT_EVERY="2")
    run = ft_driver.run_job(tmp_path, "hsdp", steps=1, groups=2, timeout=400, env=env, after=3)
    run["before"] = killed
    assert ft_driver.max_difference(run) < TOL
    # it saved too (zero=3 pieces, on a group's mesh of the merged dp axis): the serial tensors
    newest = max(int(d.name[5:]) for d in folder.iterdir() if "." not in d.name)
    assert newest > ft_driver.resumed_at(tmp_path, 2)
    _holds(folder / f"step_{newest}", ft_driver.reference(run, upto=newest))


@pytest.mark.slow
def test_three_groups_kill_the_first_the_others_train_and_it_rejoins(tmp_path):
    """3 groups of 2; group 0 (the one writing checkpoints and whose buffers the others take) is
    killed: the two others go on (group 1 now first), group 0 resumes and heals."""
    run = ft_driver.run_job(
        tmp_path, "tp", steps=6, groups=3, kill_at=3, timeout=500, victim=0, env=_ckpt_env(tmp_path)
    )
    steps = _rejoined(run)
    assert any(g == [1, 2] for g in steps.values()), steps
    firsts = ft_driver.first_groups(tmp_path, 3)
    assert 1 in firsts.values() and firsts[max(firsts)] == 0, firsts


@pytest.mark.slow
def test_hsdp_kill_and_rejoin(tmp_path):
    """zero=3 inside each group of 2, torchft across 2 groups."""
    run = ft_driver.run_job(tmp_path, "hsdp", steps=6, groups=2, kill_at=3, timeout=400)
    _rejoined(run)


def test_lighthouse_that_dies_is_a_clear_error_not_a_hang(killed):
    """Every rank of both groups exits with FaultToleranceError naming the lighthouse, within
    the quorum timeout (5 s) and the exit."""
    out = killed["lighthouse"]
    assert out["codes"] == [1, 1, 1, 1] and out["seconds"] < 20, out
    for i, err in enumerate(out["stderr"]):
        words = f"FaultToleranceError: ap.FaultTolerant: replica group {i // 2} got no quorum from the lighthouse"
        assert words in err, err[-2000:]
