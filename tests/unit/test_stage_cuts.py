"""The pipeline's automatic cut (split.balanced_cuts) against the plain dynamic program it
replaced: one start at a time, a strict ``<`` (the first start of equal cost wins)."""

import random

import pytest

from autopar.errors import PipelineError
from autopar.parallel.pipeline import split
from autopar.parallel.pipeline.split import balanced_cuts


def _plain_table(at_end, w, n_stages):
    """split._stage_table as it was: one (stage, end, start) at a time, a strict ``<``."""
    n, inf = len(at_end), float("inf")
    best = [[w[0] * float(a) for a in at_end]] + [[inf] * n for _ in range(n_stages - 1)]
    back = [[-1] * n for _ in range(n_stages)]
    for k in range(1, n_stages):
        for j in range(n):
            for i in range(j):
                v = max(best[k - 1][i], w[k] * float(at_end[j] - at_end[i]))
                if v < best[k][j]:
                    best[k][j], back[k][j] = v, i
    return back


def _plain(*args):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(split, "_stage_table", _plain_table)
        return balanced_cuts(*args)


def _cut(fn, *args):
    try:
        return fn(*args)
    except PipelineError:
        return "refused"


@pytest.mark.parametrize("seed", range(4))
def test_balanced_cuts_as_the_plain_program(seed):
    # integer costs make many ties (which start wins), weights the 1F1B memory balance
    rng = random.Random(seed)
    for _ in range(400):
        n = rng.randint(2, 40)
        ties = rng.random() < 0.5
        costs = [float(rng.choice([0, 1, 2])) if ties else rng.random() * 10 for _ in range(n)]
        candidates = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
        stages = rng.randint(1, 9)
        weights = [float(rng.randint(1, 4)) for _ in range(stages)] if rng.random() < 0.5 else None
        args = (costs, candidates, stages, weights)
        assert _cut(balanced_cuts, *args) == _cut(_plain, *args), args
