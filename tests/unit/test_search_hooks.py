"""The search asks the techniques (parallel/protocols/search.py): search/ imports no technique module,
its structures are {axis: role} with the roles the registered techniques give, each technique
offers its own choices and labels, and ap.Auto(choices={technique: ...}) is the shorthands' equal."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import autopar as ap
from autopar.models.gpt import GPT, GPTConfig
from autopar.parallel import TECHNIQUES
from autopar.parallel.protocols.search import SearchFacts
from autopar.search.candidates import Structure, structures, technique_of

SEARCH = pathlib.Path(ap.__file__).parent / "search"
# what search/ may import of parallel/: the registry and the hooks' own module, never a technique
ALLOWED = {"autopar.parallel.registry", "autopar.parallel.protocols.search"}


def test_search_imports_no_technique():
    found = {}
    for path in sorted(SEARCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad = [n for n in names if n and n.startswith("autopar.parallel") and n not in ALLOWED]
            if bad:
                found.setdefault(path.name, []).extend(bad)
    assert not found, f"search/ imports technique modules: {found}"


def test_every_role_has_one_technique():
    """The roles come from the registry: data parallel's dp and rep, the pipeline's pp, context
    parallel's cp and cp_inner; no role is claimed twice."""
    roles = [r for cls in TECHNIQUES.values() for r in cls.search_roles]
    assert len(roles) == len(set(roles))
    assert {r: technique_of(r).name for r in ("dp", "rep", "pp", "cp", "cp_inner")} == {
        "dp": "data_parallel",
        "rep": "data_parallel",
        "pp": "pipeline",
        "cp": "context_parallel",
        "cp_inner": "context_parallel",
    }


def test_structure_is_axis_to_role():
    mesh = ap.Mesh((2, 2, 2), ("a", "b", "c"))
    s = Structure.of({1: "dp", 0: "rep", 2: "tp+sp"})
    assert s.assignment == ((0, "rep"), (1, "dp"), (2, "tp+sp"))
    assert (s.dp, s.rep, s.tp, s.sp, s.pp, s.cp) == (1, 0, 2, True, None, None)
    assert s.roles(mesh) == "a=dp, b=dp, c=tp+sp"
    assert s.without_tp().roles(mesh) == "a=dp, b=dp, c=R" and not s.without_tp().uses(2)
    # every structure of a (2, 2) mesh: one role per axis at most, roles only the known ones
    every = structures(ap.Mesh((2, 2), ("a", "b")), True, None, None, True, True, ("ring",))
    known = {"tp", "tp+sp"} | {r for cls in TECHNIQUES.values() for r in cls.search_roles}
    assert every and all({r for _, r in s.assignment} <= known for s in every)
    assert len(set(every)) == len(every)
    ring = [s for s in every if s.cp is not None]
    assert ring and all(s.context_parallel(None).method == "ring" for s in ring)


def test_data_parallel_offers_its_storages():
    """zero=3 over two axes: HSDP and sharded over both; each choice reads as the search labels it."""
    mesh = ap.Mesh((2, 4), ("a", "b"))
    s = Structure.of({0: "rep", 1: "dp"})
    dp = TECHNIQUES["data_parallel"]
    choices = dp.search_space(mesh, SearchFacts(), ap.Auto(zero=(0, 3)), s)
    assert [(c.zero, c.shard_size) for c in choices] == [(0, None), (3, 4), (3, 8)]
    assert [c.search_label(mesh, s) for c in choices] == [", ZeRO-0", ", ZeRO-3 HSDP", ", ZeRO-3 sharded over both"]
    assert choices[1].gathers_weights() and not choices[0].gathers_weights()
    # a structure without data parallel: none (unless ZeRO folds over its cp axis)
    assert dp.search_space(mesh, SearchFacts(), ap.Auto(zero=(0, 3)), Structure.of({1: "tp"})) == [None]


def test_pipeline_offers_its_schedules():
    mesh = ap.Mesh((2, 2), ("a", "b"))
    s = Structure.of({0: "dp", 1: "pp"})
    pp = TECHNIQUES["pipeline"]
    facts = SearchFacts(batch=8, blocks=4)
    got = pp.search_space(mesh, facts, ap.Auto(), s)
    assert [(p.schedule, p.chunks, p.microbatches) for p in got] == [
        ("1f1b", 1, 4),
        ("zb-h1", 1, 4),
        ("interleaved", 2, 4),
        ("zbv", 2, 4),
        ("dualpipev", 2, 4),
    ]
    assert [p.search_label(mesh, s) for p in got[2:]] == [", interleaved 1F1B x2", ", ZBV", ", DualPipeV"]
    narrowed = pp.search_space(mesh, facts, ap.Auto(choices={"pipeline": ("1f1b",)}), s)
    assert [p.schedule for p in narrowed] == ["1f1b"]
    assert not pp.search_offered(ap.Auto(choices={"pipeline": ()})) and pp.search_offered(ap.Auto())
    assert pp.search_space(mesh, SearchFacts(batch=2, blocks=4), ap.Auto(), s) == []  # 1 row per dp rank < 2 stages


def test_checkpointing_and_context_parallel_offer_theirs():
    ac = TECHNIQUES["activation_checkpoint"]
    assert [None if m is None else m.label() for m in ac.search_space(None, SearchFacts(), ap.Auto())] == [
        None,
        "selective",
        "selective, 1 matmul in 2",
        "full",
    ]
    assert ac.search_space(None, SearchFacts(), ap.Auto(choices={"activation_checkpoint": ("full",)})) == [
        ap.ActivationCheckpoint("full")
    ]
    cp = TECHNIQUES["context_parallel"]
    methods, balanced = cp.search_methods(SearchFacts(sequence_lengths=(16,)), ap.Auto())
    assert methods == ("allgather", "ring", "ulysses") and balanced(4) and not balanced(16)
    assert cp.search_methods(SearchFacts(sequence_lengths=(16,), experts=True), ap.Auto())[0] == ()
    mesh = ap.Mesh((2, 2), ("a", "b"))
    hybrid = cp.search_choices(mesh, [0, 1], ("ring", "ulysses"), lambda n: True)[-1]
    assert hybrid.search_axes(mesh) == {0: "cp", 1: "cp_inner"}
    assert hybrid.search_label(mesh, None) == ", cp ring+ulysses zig-zag"


def test_auto_choices_equal_the_shorthands():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    mesh = ap.Mesh((2, 2), ("a", "b"))
    short = ap.Auto(device="cpu-gloo", zero=(0, 1), pipeline_schedules=("1f1b",), activation_checkpoint=(None,))
    by_name = ap.Auto(
        device="cpu-gloo",
        choices={"data_parallel": (0, 1), "pipeline": ["1f1b"], "activation_checkpoint": (None,)},
    )
    records = []
    for auto in (short, by_name):
        rec = dict(ap.plan(model, mesh, args=(idx, idx), auto=auto).built["auto"])
        rec.pop("search_s")
        records.append(rec)
    assert records[0] == records[1]
    assert not any("ZeRO-2" in r["option"] or "ZeRO-3" in r["option"] for r in records[0]["runners_up"])
    with pytest.raises(ap.PlanError, match="no technique"):
        ap.Auto(choices={"pipelines": ("1f1b",)})
