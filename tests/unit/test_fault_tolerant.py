"""ap.FaultTolerant without processes: what it refuses (and why), what it asks of data parallel,
the replica groups it reads off the mesh, plans that equal serial on several meshes, and the
run-time backend's routing (a fake torchft Manager). Real replica groups: gloo/test_fault_tolerant.py."""

from __future__ import annotations

import types

import pytest
import torch

import autopar as ap
from autopar.parallel.fault_tolerant.job import ReplicaJob
from autopar.parallel.fault_tolerant.runtime import ReplicaBackend, _TorchftWork


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


TP = {"0": ap.colwise("tp"), "2": ap.rowwise("tp")}
X = torch.randn(12, 8, generator=torch.Generator().manual_seed(1))


def test_shorthand_implies_data_parallel_with_each_groups_loss_mean():
    p = ap.plan(_mlp(), ap.Mesh((2, 2), ("dp", "tp")), args=(X[:8],), annotations=TP, fault_tolerant="dp")
    assert p.options.fault_tolerant == ap.FaultTolerant("dp")
    assert p.options.data_parallel.axis == "dp" and p.options.data_parallel.loss_mean == "per_rank"
    assert "fault tolerant: 2 replica groups of 2 ranks on 'dp'" in str(p)
    assert "averaged across the live replica groups on 'dp' through torchft" in str(p.explain("0.weight"))


@pytest.mark.parametrize(
    "mesh, kwargs, annotations",
    [
        (ap.Mesh((2, 2), ("dp", "tp")), dict(fault_tolerant="dp"), TP),
        (ap.Mesh((3,), ("dp",)), dict(fault_tolerant=ap.FaultTolerant("dp", min_replicas=2)), {}),
        (
            ap.Mesh((2, 2), ("dp", "shard")),
            dict(data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="dp"), fault_tolerant="dp"),
            {},
        ),
        (
            ap.Mesh((2, 2, 2), ("dp", "shard", "tp")),
            dict(data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="dp"), fault_tolerant="dp"),
            TP,
        ),
    ],
    ids=["dp2_tp2", "dp3", "hsdp2x2", "hsdp2x2_tp2"],
)
def test_plan_equals_serial(mesh, kwargs, annotations):
    """All groups present, a fault-tolerant plan is data parallel: forward and every gradient
    equal serial (plan.check runs every rank in one process)."""
    x = X[: 4 * mesh.shape[0]]
    p = ap.plan(_mlp(), mesh, args=(x,), annotations=annotations, **kwargs)
    p.check(x)


def test_replica_groups_read_off_the_mesh():
    ft = ap.FaultTolerant("dp")
    mesh = ap.Mesh((3, 2), ("dp", "tp"))
    assert ft.replicas(mesh) == 3 and [ft.replica_of(mesh, r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert ft.line(mesh, 3) == (1, 3, 5)
    p = ap.plan(
        _mlp(),
        ap.Mesh((2, 2), ("dp", "shard")),
        args=(X[:8],),
        data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="dp"),
        fault_tolerant="dp",
    )  # HSDP: one merged axis, the replica groups are its outer part
    merged = p.mesh
    assert merged.axis_names == ("dp_shard",)
    assert [ft.replica_of(merged, r) for r in range(4)] == [0, 0, 1, 1] and ft.line(merged, 1) == (1, 3)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(data_parallel=ap.DataParallel("dp", zero=1)), "ZeRO-1 keeps each rank's shard"),
        (dict(data_parallel=ap.DataParallel("dp", zero=2)), "no peer can heal it"),
        (dict(data_parallel=ap.DataParallel("dp", zero=3)), "sharded across replica groups"),
        (dict(data_parallel=ap.DataParallel("dp", local_sgd_every=2)), "local SGD averages parameters"),
        (dict(data_parallel="tp"), "split the batch on it (data_parallel='dp'"),
        (dict(pipeline=ap.Pipeline("tp", microbatches=2)), "pipeline runner sends activations"),
    ],
    ids=["zero1", "zero2", "zero3_across", "local_sgd", "other_axis", "pipeline"],
)
def test_refusals_say_why_and_what_to_do(kwargs, words):
    with pytest.raises(ap.FaultToleranceError, match="FaultTolerant") as info:
        ap.plan(_mlp(), ap.Mesh((2, 2), ("dp", "tp")), args=(X[:8],), fault_tolerant="dp", **kwargs)
    assert words in str(info.value), str(info.value)


def test_hsdp_shard_axis_is_not_the_replica_axis():
    with pytest.raises(ap.FaultToleranceError, match="replica groups are the replicate axis"):
        ap.plan(
            _mlp(),
            ap.Mesh((2, 2), ("dp", "shard")),
            args=(X[:8],),
            data_parallel=ap.DataParallel("shard", zero=3, replicate_axis="dp"),
            fault_tolerant="shard",
        )


class _WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def test_a_loss_inside_the_model_is_refused_naming_it():
    """Its mean over the batch would be all-reduced across replica groups in the forward."""
    with pytest.raises(
        ap.FaultToleranceError, match=r"broadcast_tensors .* runs a all_gather over 'dp' in the forward.*outside"
    ):
        ap.plan(_WithLoss(), ap.Mesh((2,), ("dp",)), args=(X[:8], torch.randn(8, 4)), fault_tolerant="dp")


def test_a_synced_batch_norm_is_refused_saying_plain_batch_norm_works():
    """Its whole-batch statistics are an all-reduce across groups in every forward; a plain
    batch norm's running statistics are broadcast from the first live group instead."""
    model = ap.sync_batch_norm(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16)))
    with pytest.raises(ap.FaultToleranceError, match=r"module '1'.*ap.sync_batch_norm.*use plain BatchNorm"):
        ap.plan(model, ap.Mesh((2,), ("dp",)), args=(X[:8],), fault_tolerant="dp")


@pytest.mark.parametrize("bad", [dict(replica_axis=3), dict(min_replicas=0), dict(timeout=0)])
def test_bad_options(bad):
    with pytest.raises(ap.FaultToleranceError):
        ap.FaultTolerant(**bad)


def test_plan_file_round_trip(tmp_path):
    model = _mlp()
    p = ap.plan(model, ap.Mesh((2, 2), ("dp", "tp")), args=(X[:8],), annotations=TP, fault_tolerant="dp")
    p.save(tmp_path / "ft.json")
    again = ap.load_plan(tmp_path / "ft.json", model)
    assert again.options.fault_tolerant == p.options.fault_tolerant


class _FakeManager:
    """torchft's Manager as the backend uses it: allreduce averages over the participants."""

    def __init__(self, participants):
        self.participants, self.calls = participants, []

    def allreduce(self, flat):
        self.calls.append(flat.clone())
        flat.div_(self.participants)  # as torchft's AVG: (here, one group's part) / n
        return types.SimpleNamespace(wait=lambda: True)


def test_gradient_bucket_goes_through_torchft_scaled_to_the_groups_mean():
    """A bucket holds g / |dp| (the loss scale); torchft divides the groups' sum by the n taking
    part; the backend multiplies by the plan's group count: the survivors' mean of g."""
    manager = _FakeManager(participants=1)  # 3 groups planned, one left
    job = ReplicaJob(ap.FaultTolerant("dp"), manager, replica=0, replicas=3)
    backend = ReplicaBackend(inner=None, local={0: 0, 1: 1}, line=(0, 2, 4), job=job)
    g = torch.tensor([3.0, 6.0])
    out = backend.all_reduce_async(g / 3, (0, 2, 4), 0).wait()
    torch.testing.assert_close(out, g)  # alone: its own gradient, unscaled
    assert isinstance(_TorchftWork(job, torch.ones(1)), _TorchftWork) and len(manager.calls) == 2


def test_collectives_crossing_groups_other_than_gradients_and_buffers_are_refused():
    job = ReplicaJob(ap.FaultTolerant("dp"), _FakeManager(2), replica=0, replicas=2)
    inner = types.SimpleNamespace(all_gather=print, all_reduce=print)  # never reached
    backend = ReplicaBackend(inner=inner, local={0: 0, 1: 1}, line=(0, 2), job=job)
    with pytest.raises(ap.FaultToleranceError, match=r"an all_reduce over ranks \(0, 2\) crosses replica groups"):
        backend.all_reduce(torch.ones(2), (0, 2), 0, "sum")
    with pytest.raises(ap.FaultToleranceError, match="ap.sync_batch_norm"):
        backend.all_gather(torch.ones(2), 0, (0, 2), 0)


class _SumManager:
    """torchft's Manager for a broadcast across groups: this group's place in the step's quorum,
    and a SUM all-reduce whose other groups' part is ``others``."""

    def __init__(self, participating_rank, others):
        self.rank, self.others = participating_rank, others

    def participating_rank(self):
        return self.rank

    def allreduce(self, flat, reduce_op):
        assert reduce_op == torch.distributed.ReduceOp.SUM
        flat.add_(self.others)
        return types.SimpleNamespace(wait=lambda: True)


@pytest.mark.parametrize("first", [True, False])
def test_buffer_broadcast_across_groups_comes_from_the_first_group_taking_part(first):
    """buffer_sync's broadcast over a dp group crossing replica groups: first inside this group
    (from its first rank), then across groups from the first group in the step's quorum, which
    adds its values to the others' zeros."""
    mine, theirs = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 7.0])
    manager = _SumManager(0, torch.zeros(2)) if first else _SumManager(1, theirs)
    job = ReplicaJob(ap.FaultTolerant("dp"), manager, replica=0 if first else 1, replicas=2)
    inside = []
    inner = types.SimpleNamespace(broadcast=lambda x, group, rank: inside.append((group, rank)))
    local = {0: 0, 1: 1} if first else {2: 0, 3: 1}  # HSDP: dp group (0, 1, 2, 3), groups of 2
    backend = ReplicaBackend(inner=inner, local=local, line=(1, 3), job=job)
    out = backend.broadcast(mine.clone(), (0, 1, 2, 3), 1 if first else 3)
    torch.testing.assert_close(out, mine if first else theirs)
    assert inside == [((0, 1), 1)]  # the group's own part, in its job's ranks


@pytest.mark.parametrize("first", [True, False])
def test_step_zero_every_group_takes_the_first_groups_weights(first):
    """torchft's own start sync (init_sync) heals each rank's line from another group; instead
    every tensor of the rank (parameters and buffers, one all-reduce per dtype) is the first
    group's at step 0."""
    torch.manual_seed(0 if first else 1)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    mine = {k: v.clone() for k, v in module.state_dict().items()}
    sums = {torch.float32: torch.zeros(36), torch.int64: torch.zeros(1, dtype=torch.int64)}
    if not first:  # what the first group adds to this group's zeros
        sums = {
            torch.float32: torch.cat([v.reshape(-1) for v in theirs.state_dict().values() if v.is_floating_point()]),
            torch.int64: theirs.state_dict()["1.num_batches_tracked"].reshape(1),
        }

    class _PerDtype(_SumManager):
        def allreduce(self, flat, reduce_op):
            self.others = sums[flat.dtype]
            return super().allreduce(flat, reduce_op)

    job = ReplicaJob(ap.FaultTolerant("dp"), _PerDtype(0 if first else 1, None), replica=0, replicas=2)
    job.module = module
    job.sync_start()
    want = mine if first else theirs.state_dict()
    for k, v in module.state_dict().items():
        assert v.equal(want[k]), k


def test_written_buffers_undone_on_a_dropped_step_and_kept_when_healed():
    """A step that does not commit runs its forward again: the running statistics it wrote go
    back. A healing group keeps the synced buffers its forward's broadcast gave it (the peer
    sends its values from before the step) and takes everything else from the peer."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    job = ReplicaJob(ap.FaultTolerant("dp"), None, replica=0, replicas=2)
    job.module, job.written = module, ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    job.synced = {"1.running_mean", "1.num_batches_tracked"}
    job.optimizer = types.SimpleNamespace(inner=torch.optim.SGD(module.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    job.begin_step()
    module(torch.randn(8, 4))  # the forward writes the running statistics
    assert job._state()["tensors"]["1.running_mean"].equal(before["1.running_mean"])  # a peer gets the step's start
    job.end_step(committed=False)
    for k, v in module.state_dict().items():
        assert v.equal(before[k]), k
    job.begin_step()
    module(torch.randn(8, 4))
    after = {k: v.clone() for k, v in module.state_dict().items()}
    peer = {k: torch.full_like(v, 3) for k, v in module.state_dict().items()}
    job._load({"tensors": peer, "optimizer": job.optimizer.inner.state_dict()})
    for k, v in module.state_dict().items():
        assert v.equal(after[k] if k in job.synced else peer[k]), k


def test_lighthouse_starts_fast_and_stops():
    from autopar.parallel.fault_tolerant import start_lighthouse

    with start_lighthouse() as lh:
        assert lh.alive() and lh.address.startswith("http://")
    assert not lh.alive()
