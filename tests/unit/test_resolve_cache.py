"""The search's cache of resolve's seeds (planner._resolved) against resolve itself, under
changed annotations, meshes, data axes and input dims, and with the copies it hands out changed
by their callers (the techniques add to the seeds)."""

import torch.nn as nn

import autopar as ap
from autopar.placement import Shard
from autopar.planner import _resolved
from autopar.sharding.annotations import resolve


def test_cached_seeds_as_resolve_under_changed_arguments():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    split = {"0": ap.colwise("tp"), "2": ap.rowwise("tp")}
    calls = [
        (split, ap.Mesh((2, 2), ("dp", "tp")), "dp", {"x": 2}),
        (split, ap.Mesh((2, 2), ("dp", "tp")), None, {"x": 2}),
        ({"0": ap.colwise("tp")}, ap.Mesh((2, 2), ("dp", "tp")), "dp", {"x": 2}),
        ({"0": ap.colwise("dp"), "2": ap.rowwise("dp")}, ap.Mesh((2, 2), ("dp", "tp")), "tp", {"x": 2}),
        (split, ap.Mesh((4, 1), ("dp", "tp")), "dp", {"x": 2}),
        (split, ap.Mesh((2, 2), ("dp", "tp")), "dp", {"x": 0}),
        ({"0": ap.colwise("tp", output=Shard(0))}, ap.Mesh((2, 2), ("dp", "tp")), "dp", {"x": 2}),
        ({}, ap.Mesh((2, 2), ("dp", "tp")), "dp", {"x": 2}),
    ]
    cache: dict = {}
    for _ in range(2):  # the second round from the cache
        for ann, mesh, dp, ndims in calls:
            got = _resolved(cache, ann, model, mesh, ["x"], dp, ndims)
            assert got == resolve(ann, model, mesh, ["x"], dp, ndims)
            for table in (got.params, got.inputs, got.reasons, got.module_outputs):  # a caller's changes
                for k in list(table):
                    if isinstance(table[k], dict):
                        table[k].clear()
                table["added"] = ()
    assert len(cache) == 6  # by annotations and mesh: the data axis and input dims are added to each copy
