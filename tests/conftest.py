"""Shared fixtures: small models, and gloo worker pools started once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from autopar.runtime.gloo_pool import GlooPool

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

_POOLS: dict[int, GlooPool] = {}


@pytest.fixture(scope="session")
def gloo():
    """gloo(world_size) -> a started GlooPool of that size, shared by the whole session."""

    def get(world_size: int) -> GlooPool:
        if world_size not in _POOLS:
            _POOLS[world_size] = GlooPool(world_size).start()
        return _POOLS[world_size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
