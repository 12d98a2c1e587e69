"""``import autopar`` pays for torch and what autopar itself needs, not for torch.compile's
machinery or the search's solver: torch._dynamo (with inductor's config, FSDP1 and DTensor's op
strategies behind it) and scipy are imported where they are used (issue 40: 4.5 s against
torch's 2.3 s)."""

from __future__ import annotations

import os
import subprocess
import sys

import autopar as ap

HEAVY = (
    "torch._dynamo",
    "torch._inductor.config",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "scipy",
    "scipy.optimize",
)


def test_import_autopar_leaves_heavy_modules_unloaded():
    code = f"import sys, autopar; print([m for m in {HEAVY!r} if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ap.__file__)), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_eager_runs_under_compile_as_disable():
    """``runtime.eager``: a plain call before torch._dynamo is imported, a graph break under
    torch.compile (the function's Python-side effect happens on every compiled call)."""
    import torch

    from autopar.runtime.eager import eager

    calls = []

    @eager
    def side(x):
        calls.append(float(x.shape[0]))  # not traceable as a value: eager
        return x * 2

    compiled = torch.compile(lambda x: side(x + 1) - 1, backend="eager")
    x = torch.ones(3)
    for _ in range(2):
        assert torch.equal(compiled(x), torch.full((3,), 3.0))
    assert calls == [3.0, 3.0]
