"""Hypothesis strategies that draw fuzz cases (see fuzz/spec.py for the case format).

Example:
    >>> from hypothesis import given
    >>> @given(cases())
    ... def test(case): run_case(case)
"""
from __future__ import annotations

from hypothesis import strategies as st

from .spec import ACTS

DIMS = (4, 6, 8, 12)


@st.composite
def blocks(draw, d: int) -> list:
    out = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("linear", "act", "norm", "attn", "residual")))
        if kind == "linear":
            spec = {"kind": "linear", "out": draw(st.sampled_from(DIMS)), "bias": draw(st.booleans())}
            d = spec["out"]
        elif kind == "act":
            spec = {"kind": "act", "fn": draw(st.sampled_from(sorted(ACTS)))}
        elif kind == "norm":
            spec = {"kind": "norm"}
        elif kind == "attn":
            spec = {"kind": "attn", "heads": draw(st.sampled_from([h for h in (1, 2, 3, 4) if d % h == 0]))}
        else:
            spec = {"kind": "residual", "hidden": draw(st.sampled_from(DIMS)),
                    "fn": draw(st.sampled_from(sorted(ACTS)))}
        out.append(spec)
    return out


@st.composite
def meshes(draw):
    sizes = []
    for _ in range(draw(st.integers(1, 3))):
        room = 8 // max(1, _prod(sizes))
        sizes.append(draw(st.sampled_from([s for s in (1, 2, 3, 4) if s <= room])))
    return [sizes, [f"a{i}" for i in range(len(sizes))]]


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def layer_paths(case: dict) -> list[str]:
    """Module paths that colwise / rowwise may name (Linear and Embedding modules)."""
    paths = ["embed"] if case["vocab"] else []
    for i, b in enumerate(case["blocks"]):
        paths += {"linear": [f"blocks.{i}"], "attn": [f"blocks.{i}.qkv", f"blocks.{i}.proj"],
                  "residual": [f"blocks.{i}.fc1", f"blocks.{i}.fc2"]}.get(b["kind"], [])
    return paths


@st.composite
def annotations(draw, case: dict) -> list:
    names = case["mesh"][1]
    paths = layer_paths(case)
    out = []
    if paths:
        chosen = draw(st.lists(st.sampled_from(paths), max_size=min(4, len(paths)), unique=True))
        for p in chosen:
            out.append([p, draw(st.sampled_from(("colwise", "rowwise", "replicate"))),
                        draw(st.sampled_from(names))])
    if draw(st.integers(0, 5)) == 0:  # an explicit input layout now and then
        ndim = 2 if case["vocab"] else 3
        out.append(["x", "place", [draw(st.sampled_from([None] + list(range(ndim)))) for _ in names]])
    return out


@st.composite
def cases(draw) -> dict:
    vocab = draw(st.sampled_from((0, 0, 8, 12)))
    d = draw(st.sampled_from(DIMS))
    case = {"seed": draw(st.integers(0, 2**16)), "vocab": vocab, "d": d,
            "batch": draw(st.sampled_from((2, 4, 6, 8))), "seq": draw(st.sampled_from((2, 4))),
            "blocks": draw(blocks(d)), "mesh": draw(meshes())}
    case["dp"] = draw(st.sampled_from([None] + case["mesh"][1]))
    case["annotations"] = draw(annotations(case))
    return case
