"""torch.compile of context-parallel rank modules (inductor): the LLaMA-style model on (2,), load
balanced, ring, all-gather and Ulysses, and hybrid ring + Ulysses on (2, 2): forward and every
gradient equal serial and the eager rank modules. Ulysses compiles into one graph per rank (its
all-to-alls are graph ops, its one block of attention has no collective inside); hybrid breaks
where its ring does.

Found here: compiled, each rank's graph differs (load balancing gives each rank its own block
plan), and inductor ordered the K and V gradients' two reduce-scatters differently on the two
ranks (rank 0 summed its dV with rank 1's dK). All-gather now moves K and V by one op
(``autopar::all_gather_rs_pair``, backward ``reduce_scatter_pair``) that runs both in one order.
The ring's shifts call the backend from inside its autograd.Function: Dynamo breaks the graph
there and runs the attention eagerly (counted below)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import autopar as ap
from autopar.runtime.simulator import run_ranks
from tests.harness.llama_like import llama_batch, llama_like


@pytest.fixture(autouse=True)
def _enough_recompiles():
    import torch._dynamo

    old = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64  # every simulated rank recompiles the same code
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.config.cache_size_limit = old


def _run(plan, state, batch, wrap, calls=2):
    """Each rank's outputs of the last call and its accumulated gradients (``calls`` steps)."""
    modules = [plan.build_module(r, state) for r in plan.mesh.ranks()]
    runs = [wrap(m) for m in modules]
    inputs = [plan.local_inputs(r, *batch) for r in plan.mesh.ranks()]

    def step(rank):
        a, k = inputs[rank]
        for _ in range(calls):
            out = runs[rank](*a, **k)
            out[1].backward()
        return out

    outs = run_ranks(plan.mesh.size, step)
    return outs, [{n: p.grad for n, p in m.named_parameters()} for m in modules]


# the ring case (its attention eager between compiled pieces) runs in `make fuzz`: allgather is the one whose
# collectives inductor could reorder; Ulysses' one graph per rank is dynamo's capture, checked with aot_eager
# (inductor's codegen of it, 29 s on a cold cache, in `make fuzz`); hybrid (ring + Ulysses on (2, 2)) compiles
# four ranks: slow
@pytest.mark.parametrize(
    "method,backend",
    [
        ("allgather", "inductor"),
        ("ulysses", "aot_eager"),
        pytest.param("ulysses", "inductor", marks=pytest.mark.slow),
        pytest.param("ring", "inductor", marks=pytest.mark.slow),
        pytest.param("hybrid", "inductor", marks=pytest.mark.slow),
    ],
)
def test_compiled_rank_modules_equal_serial_and_eager(method, backend):
    model = llama_like()
    batch = llama_batch(batch=4)
    if method == "hybrid":  # the ring across cpr, Ulysses within cpu
        cp = ap.ContextParallel(("cpr", "cpu"), method=("ring", "ulysses"), load_balance=True)
        mesh = ap.Mesh((2, 2), ("cpr", "cpu"))
    else:
        cp, mesh = ap.ContextParallel("cp", method=method, load_balance=True), ap.Mesh((2,), ("cp",))
    plan = ap.plan(model, mesh, args=batch, context_parallel=cp)
    state = {n: p.detach() for n, p in model.named_parameters()}
    eager_out, eager_g = _run(plan, state, batch, lambda m: m)
    out, grads = _run(plan, state, batch, lambda m: torch.compile(m, backend=backend))

    for r in plan.mesh.ranks():  # compiled = eager, rank by rank
        torch.testing.assert_close(out[r][0], eager_out[r][0], rtol=1e-5, atol=1e-6)
        for name, g in eager_g[r].items():
            torch.testing.assert_close(grads[r][name], g, rtol=1e-4, atol=1e-6, msg=f"rank {r}: {name}")

    serial = model(*batch)
    for _ in range(2):
        model(*batch)[1].backward()
    merged = plan.merge_outputs(out)
    torch.testing.assert_close(merged[0], serial[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged[1], serial[1], rtol=1e-4, atol=1e-5)
    merged_g = plan.merge_state_dicts(grads)
    for name, p in model.named_parameters():
        torch.testing.assert_close(merged_g[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)

    breaks = sum(counters["graph_break"].values())
    if method in ("allgather", "ulysses"):
        assert breaks == 0, dict(counters["graph_break"])  # one graph per rank, collectives in it
    else:  # the ring runs eagerly inside the compiled module: a break per attention call and rank
        assert 0 < breaks <= 6 * plan.mesh.size, dict(counters["graph_break"])
