"""Hypothesis strategies that draw fuzz cases (see fuzz/spec.py for the case format).

The model part of a case comes from a numbered family (``model_spec(k)``): CI draws from a
small pool, so that each traced model is reused by many meshes and annotations (tracing is
the slow part); ``make fuzz`` draws from a million.

Example:
    >>> from hypothesis import given
    >>> @given(cases(pool=12))
    ... def test(case): run_case(case)
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from .moe import ROUTERS
from .spec import ACTS

DIMS = (4, 6, 8, 12)
KINDS = ("linear", "act", "norm", "attn", "residual")
EXTRA_KINDS = ("noise", "bn")  # issue 32: random ops, batch norm (one model in EXTRA_EVERY has one)
EXTRA_EVERY = 3
UNEVEN_EVERY = 2  # issue 24: half the models take sizes that divide by no mesh axis (uneven pieces)
MOE_EVERY = 8  # issue 26: one model in eight has a mixture-of-experts block (fuzz/moe.py)


def model_spec(k: int) -> dict:
    """Model number ``k``: an optional embedding and 1-4 blocks of tiny sizes."""
    rng = random.Random(k)
    d = rng.choice(DIMS)
    spec = {
        "seed": k,
        "vocab": rng.choice((0, 0, 8, 12)),
        "d": d,
        "batch": rng.choice((2, 4, 6, 8)),
        "seq": rng.choice((2, 4)),
        "blocks": [],
    }
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(KINDS)
        if kind == "linear":
            block = {"kind": "linear", "out": rng.choice(DIMS), "bias": rng.random() < 0.7}
            d = block["out"]
        elif kind == "act":
            block = {"kind": "act", "fn": rng.choice(sorted(ACTS))}
        elif kind == "norm":
            block = {"kind": "norm"}
        elif kind == "attn":
            block = {"kind": "attn", "heads": rng.choice([h for h in (1, 2, 3, 4) if d % h == 0])}
        else:
            block = {"kind": "residual", "hidden": rng.choice(DIMS), "fn": rng.choice(sorted(ACTS))}
        spec["blocks"].append(block)
    if rng.randrange(EXTRA_EVERY) == 0:  # drawn after the blocks: the earlier models stay as they were
        kind = rng.choice(EXTRA_KINDS)
        block = {"kind": kind, "ops": rng.randrange(1, 32)} if kind == "noise" else {"kind": kind}
        spec["blocks"].insert(rng.randrange(len(spec["blocks"]) + 1), block)
    if rng.randrange(UNEVEN_EVERY) == 0:  # drawn last too: odd batch, vocabulary and hidden sizes
        spec["batch"] = rng.choice((3, 5, 7))
        spec["vocab"] = rng.choice((7, 13)) if spec["vocab"] else 0
        for block in spec["blocks"]:
            if block["kind"] == "residual":
                block["hidden"] = rng.choice((5, 7, 9))
    if rng.randrange(MOE_EVERY) == 0:  # drawn last too
        spec["blocks"].insert(rng.randrange(len(spec["blocks"]) + 1), moe_block(rng, k))
    return spec


MOE_FORMS = (("stacked", "chunk"), ("stacked", "interleave"), ("stacked", "plain"), ("list", None))


def moe_block(rng: random.Random, k: int) -> dict:
    """A MoE block: 2-4 experts (3 divides few meshes: a clean refusal), top-1 or 2, stacked 3-D
    experts (three layouts) or a ModuleList by the model's number (so that a small pool has each),
    with or without expert biases, two router forms."""
    experts = rng.choice((2, 2, 3, 4, 4))
    form, layout = MOE_FORMS[k % len(MOE_FORMS)]
    block = {
        "kind": "moe",
        "experts": experts,
        "top_k": rng.choice([k for k in (1, 2) if k <= experts]),
        "ffn": rng.choice((4, 6, 8, 5)),
        "form": form,
        "bias": rng.random() < 0.4,
        "router": rng.choice(ROUTERS),
        "renorm": rng.random() < 0.5,
    }
    if layout is not None:
        block["layout"] = layout
    return block


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
        paths += {
            "linear": [f"blocks.{i}"],
            "attn": [f"blocks.{i}.qkv", f"blocks.{i}.proj"],
            "residual": [f"blocks.{i}.fc1", f"blocks.{i}.fc2"],
            "moe": [f"blocks.{i}.gate"],  # the router (its experts: expert_annotations)
        }.get(b["kind"], [])
    return paths


@st.composite
def annotations(draw, case: dict) -> list:
    names = case["mesh"][1]
    paths = layer_paths(case)
    out = []
    if paths:
        chosen = draw(st.lists(st.sampled_from(paths), max_size=min(4, len(paths)), unique=True))
        for p in chosen:
            out.append([p, draw(st.sampled_from(("colwise", "rowwise", "replicate"))), draw(st.sampled_from(names))])
    if draw(st.integers(0, 5)) == 0:  # an explicit input layout now and then
        ndim = 2 if case["vocab"] else 3
        out.append(["x", "place", [draw(st.sampled_from([None] + list(range(ndim)))) for _ in names]])
    return out


@st.composite
def cases(draw, pool: int = 12) -> dict:
    case = model_spec(draw(st.integers(0, pool - 1)))
    case["mesh"] = draw(meshes())
    case["dp"] = draw(st.sampled_from([None] + case["mesh"][1]))
    case["annotations"] = draw(annotations(case))
    if case["dp"] is not None:  # drawn last: the earlier draws (and CI's derandomized cases) stay
        case["zero"] = draw(st.sampled_from([0, 0, 3]))  # a third of the dp cases fully sharded
    # activation checkpointing of every block, two cases in five (drawn last, as zero)
    case["checkpoint"] = draw(st.sampled_from([None, None, None, "full", "selective"]))
    if case["checkpoint"]:  # kept tensors in host memory, half the checkpointed cases (drawn last)
        case["offload"] = draw(st.booleans())
    # context parallel on an axis other than dp, one case in four (drawn last): [axis, method, load balanced]
    others = [a for a in case["mesh"][1] if a != case["dp"]]
    if others and draw(st.integers(0, 3)) == 0:
        noise = any(b["kind"] == "noise" for b in case["blocks"])  # draws by placement need contiguous pieces
        balanced = False if noise else draw(st.booleans())
        case["cp"] = [draw(st.sampled_from(others)), draw(st.sampled_from(["allgather", "ring"])), balanced]
        names = case["mesh"][1]
        right_after_dp = case["dp"] is not None and names.index(case["cp"][0]) == names.index(case["dp"]) + 1
        if case.get("zero") == 3 and right_after_dp:  # cp folded into zero=3's shard group, half of these
            case["fold"] = draw(st.booleans())  # (other axis orders are refused: unit tests)
        on_cp_axis(draw, case)
    expert_annotations(draw, case)  # drawn last
    long_context(draw, case)  # drawn last too: the cases drawn before stay as they were
    return case


def long_context(draw, case: dict) -> None:
    """issue 47: a cp case's method Ulysses (one in three), hybrid over the cp axis and the next
    free one (one in four where there is one: ring or all-gather across, Ulysses within), and its
    attention blocks over packed documents (one in three where the sequence holds two or more)."""
    if not case.get("cp") or any(b["kind"] == "moe" for b in case["blocks"]):
        return
    names = case["mesh"][1]
    axis, method, balanced = case["cp"]
    if draw(st.integers(0, 2)) == 0:
        case["cp"] = [axis, "ulysses", balanced]
    i = names.index(axis)
    named = {a[2] for a in case["annotations"] if a[1] in ("colwise", "rowwise")} | {case["dp"]}
    inner = names[i + 1] if i + 1 < len(names) else None
    placed = any(a[1] == "place" for a in case["annotations"])  # a layout names each axis: not the merged one
    if inner and not case.get("fold") and not placed and not {axis, inner} & named and draw(st.integers(0, 3)) == 0:
        case["cp"] = [[axis, inner], [method, "ulysses"], balanced]
        case["seq"] = 4 * case["mesh"][0][i] * case["mesh"][0][i + 1]  # a sequence the merged axis cuts (zig-zag too)
    attention = [b for b in case["blocks"] if b["kind"] == "attn"]
    if attention and case["seq"] >= 4 and draw(st.integers(0, 2)) == 0:
        for b in attention:
            b["doc"] = case["seq"] // 2


def on_cp_axis(draw, case: dict) -> None:
    """issue 52: a layer split on the context-parallel axis too, one cp case in two (a layer of the
    model colwise or rowwise there, replacing its own annotation): the pieces of its weights are
    plain while the sequence's may be zig-zag, which the emitted program must keep apart."""
    paths = layer_paths(case)
    if not paths or draw(st.integers(0, 1)):
        return
    path, kind = draw(st.sampled_from(paths)), draw(st.sampled_from(("colwise", "rowwise")))
    case["annotations"] = [a for a in case["annotations"] if a[0] != path] + [[path, kind, case["cp"][0]]]


def _replicate_axis(draw, case: dict):
    """The axis right before dp, to make the data parallelism two-axis (so that the experts can go
    over one part of it), one case in two where no other annotation names either axis."""
    names, dp = case["mesh"][1], case["dp"]
    if dp is None or names.index(dp) == 0 or case.get("fold"):
        return None  # (a folded cp makes the shard group two axes already)
    rep = names[names.index(dp) - 1]
    named = {a[2] for a in case["annotations"] if a[1] in ("colwise", "rowwise")}  # the two become one axis
    if {rep, dp} & named or any(a[1] == "place" for a in case["annotations"]) or rep == (case.get("cp") or [None])[0]:
        return None
    return rep if draw(st.booleans()) else None


def expert_annotations(draw, case: dict) -> None:
    """issue 26: each MoE block's experts annotated ap.expert_parallel (three in four) on the axis
    that splits the batch (mostly), a part of a two-axis data parallelism or both, or another axis
    (tokens replicated there), with expert tensor parallelism on a free axis three times in four (the
    ZeRO level is the case's: 0 or 3, the levels the fuzzer's modes train with)."""
    moe = [i for i, b in enumerate(case["blocks"]) if b["kind"] == "moe"]
    if not moe:
        return
    names, dp = case["mesh"][1], case["dp"]
    rep = _replicate_axis(draw, case)
    if rep is not None:
        case["dp_replicate"] = rep
    batch = [dp, dp, dp] + ([rep, [rep, dp]] if rep else []) if dp is not None else []
    for i in moe:
        if draw(st.integers(0, 3)) == 0:
            continue  # not annotated: recognised all the same (plain data parallelism keeps tokens split)
        on = draw(st.sampled_from(batch + [a for a in names if a not in (dp, rep)] or names))
        used = set(on) if isinstance(on, list) else {on}
        free = [a for a in names if a not in used | {dp, rep}]
        tp = draw(st.sampled_from(free)) if free and draw(st.integers(0, 3)) > 0 else None
        case["annotations"].append([f"blocks.{i}.experts", "expert", [on, tp]])
