"""Pipeline schedules as plain data: for each rank, the ordered list of actions it runs.

An action is ``Action("F" | "B" | "W", microbatch, stage)``: "B" is a stage's whole backward, or
under a zero-bubble schedule ("zb-h1") its input-gradient part only, "W" then its weight-gradient
part, run later (parallel/pipeline/split_backward.py). Stage s lives on rank s % pp (with
``chunks`` > 1, rank r holds stages r, r + pp, ...; V_SHAPED schedules: stages r and 2pp - 1 - r). Pure Python, no torch: the runner
executes these lists, and ``replay`` puts them on a time axis from their dependencies
(forward of stage s after forward of s - 1, backward of s after backward of s + 1), which
gives the schedule table, the bubble, and a deadlock check.

Example:
    >>> [str(a) for a in build("1f1b", pp=2, microbatches=3)[0]]
    ['F0.s0', 'F1.s0', 'B0.s0', 'F2.s0', 'B1.s0', 'B2.s0']
"""

from __future__ import annotations

from typing import NamedTuple

from autopar.errors import PipelineError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules whose backward is B (input gradients) then W (weights)
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, rank r holding stages r and 2pp - 1 - r (v_rank)


class Action(NamedTuple):
    """A tuple (made, hashed and compared in C: a schedule of a 512-rank search's pipelines has
    tens of thousands, replayed for each pipeline it costs)."""

    kind: str  # "F" forward, "B" backward (input gradients only where the schedule has "W"), "W" weights
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.s{self.stage}"


def build(kind: str, pp: int, microbatches: int, chunks: int = 1, forward_only: bool = False) -> list[list[Action]]:
    """Actions per pipeline rank for schedule ``kind`` (one of SCHEDULES)."""
    if kind == "gpipe":
        out = [gpipe(pp, microbatches, r) for r in range(pp)]
    elif kind == "1f1b":
        out = [one_f_one_b(pp, microbatches, r) for r in range(pp)]
    elif kind == "interleaved":
        out = [interleaved(pp, microbatches, chunks, r) for r in range(pp)]
    elif kind == "zb-h1":
        out = [zb_h1(pp, microbatches, r) for r in range(pp)]
    elif kind == "zbv":
        out = zbv(pp, microbatches)
    elif kind == "dualpipev":
        out = [dualpipev(pp, microbatches, r) for r in range(pp)]
    else:
        raise PipelineError(f"Unknown schedule {kind!r}.")
    if forward_only:
        out = [[a for a in acts if a.kind == "F"] for acts in out]
    return out


def gpipe(pp: int, m: int, r: int) -> list[Action]:
    """Fill-drain: every forward, then every backward (all m micro-batches held at once)."""
    return [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]


def one_f_one_b(pp: int, m: int, r: int) -> list[Action]:
    """PipeDream-flush 1F1B: pp - r - 1 warm-up forwards, then one forward / one backward."""
    warmup = min(pp - r - 1, m)
    acts = [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [Action("F", warmup + i, r), Action("B", i, r)]
    acts += [Action("B", i, r) for i in range(m - warmup, m)]
    return acts


def zb_h1(pp: int, m: int, r: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al., 2023): 1F1B's forwards and input-gradient backwards (B), each
    weight-gradient part (W) deferred on rank r until r more B's have run.

    The deferred W's fill what 1F1B leaves idle: a B now takes one slot, not two, so its gradient
    reaches the rank before sooner, and the last ranks' W's run while the first ranks finish
    their B's. With F, B and W one slot each, a rank idles p - 1 slots of 3m + p - 1 (1F1B: 3(p - 1)
    of 3(m + p - 1)), a third of 1F1B's bubble. Rank r holds at most p micro-batches (1F1B: p - r):
    the peak over ranks is 1F1B's, on every rank.

    Example:
        >>> [str(a) for a in zb_h1(2, 3, 1)]
        ['F0.s1', 'B0.s1', 'F1.s1', 'B1.s1', 'W0.s1', 'F2.s1', 'B2.s1', 'W1.s1', 'W2.s1']
    """
    acts, done_b, done_w = [], 0, 0
    for a in one_f_one_b(pp, m, r):
        acts.append(a)
        if a.kind == "B":
            done_b += 1
            if done_b - done_w > r:
                acts.append(Action("W", done_w, r))
                done_w += 1
    return acts + [Action("W", i, r) for i in range(done_w, m)]


def v_rank(stage: int, pp: int) -> int:
    """ZBV's V-shaped placement: stages 0 .. pp - 1 down the ranks, pp .. 2pp - 1 back up (rank r
    holds stages r and 2pp - 1 - r; the last rank runs the middle two, the first the two ends)."""
    return stage if stage < pp else 2 * pp - 1 - stage


def zbv(pp: int, m: int) -> list[list[Action]]:
    """Zero-bubble V (Qi et al., 2024): two chunks per rank placed in a V (``v_rank``), each backward
    split into B and W, the order found by running every rank on unit slots: at each slot a rank
    runs a ready B (the later stage first), else a forward whose input is there while it holds
    fewer than 2pp micro-batch chunks (1F1B's first rank's activations), the later stage first,
    else its oldest pending W. A fixed order that one run of the whole pipeline followed cannot
    deadlock under other durations (each rank waits only on actions that run earlier in it).

    Example:
        >>> [str(a) for a in zbv(2, 2)[1]][:4]
        ['F0.s1', 'F0.s2', 'F1.s1', 'F1.s2']
    """
    n = 2 * pp
    mine = [(2 * pp - 1 - r, r) for r in range(pp)]  # later stage first
    nxt = {k: [0] * n for k in "FBW"}
    done: dict = {}
    out: list[list[Action]] = [[] for _ in range(pp)]
    t, left = 0, 3 * n * m
    while left:
        picks = []
        for r in range(pp):
            picks.append(_zbv_pick(mine[r], nxt, done, t, n, m, 2 * pp))
        if not any(picks):  # cannot happen with a cap of 2pp; a loud stop rather than a hang
            raise PipelineError(f"ZBV's order stalled at slot {t} (pp={pp}, m={m}).")
        for r, a in enumerate(picks):
            if a is not None:
                done[a] = t + 1
                out[r].append(a)
                nxt[a.kind][a.stage] += 1
                left -= 1
        t += 1
    return out


def dualpipev(pp: int, m: int, r: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab 2025) on rank r: ZBV's V placement
    (``v_rank``: chunk 0 = stage r, chunk 1 = stage 2pp - 1 - r), in DualPipe's eight phases. Its
    steady phase pairs the forward of one micro-batch in one chunk with the backward of another in
    the other chunk (``overlapped`` names the pairs), so that one's messages travel while the other
    computes; warm-up and cool-down defer W's (zero bubble) into the gaps. A backward outside the
    zero-bubble phases is B followed at once by its W (the runner always splits: they sum to the
    whole backward). Needs m >= 2pp (Pipeline checks it).

    Example:
        >>> [str(a) for a in dualpipev(2, 4, 1)][:8]
        ['F0.s1', 'F0.s2', 'F1.s1', 'F1.s2', 'F2.s1', 'B0.s2', 'W0.s2', 'F2.s2']
    """
    return _dualpipev(pp, m, r)[0]


def overlapped(kind: str, pp: int, m: int) -> list[set]:
    """Per rank, the (forward, backward) Action pairs the schedule overlaps (DualPipeV's steady
    phase; empty for the others): what the schedule table and the figure mark."""
    if kind != "dualpipev":
        return [set() for _ in range(pp)]
    return [_dualpipev(pp, m, r)[1] for r in range(pp)]


def _dualpipev(pp: int, m: int, r: int) -> tuple[list[Action], set]:
    if m < 2 * pp:  # its phases count on it (the main phase runs m - 2pp + r + 1 times)
        raise PipelineError(
            f"schedule='dualpipev' needs at least 2 x pp micro-batches: pp={pp}, microbatches={m}. "
            f"Use microbatches >= {2 * pp}, or schedule='zbv'."
        )
    # The phases follow deepseek-ai/DualPipe's dualpipev.py step by step (its step_1 .. step_8);
    # "zb" backwards leave their W in a queue that a later W slot takes from, oldest first.
    stage = (r, 2 * pp - 1 - r)
    acts: list[Action] = []
    pairs: set = set()
    nf, nb, queue = [0, 0], [0, 0], []

    def f(c):
        acts.append(Action("F", nf[c], stage[c]))
        nf[c] += 1

    def b(c, zb=False):
        a = Action("B", nb[c], stage[c])
        acts.append(a)
        nb[c] += 1
        (queue.append if zb else acts.append)(Action("W", a.microbatch, a.stage))

    def w():
        acts.append(queue.pop(0))

    def fb(cf, cb):  # one micro-batch's forward beside another's backward
        pairs.add((Action("F", nf[cf], stage[cf]), Action("B", nb[cb], stage[cb])))
        f(cf)
        b(cb)

    for _ in range(2 * (pp - r - 1)):  # 1: chunk 0's forwards ahead
        f(0)
    for _ in range(r + 1):  # 2: F0 F1
        f(0)
        f(1)
    for _ in range(pp - r - 1):  # 3: B1 W1 F1, zero bubble
        b(1, zb=True)
        w()
        f(1)
    for i in range(m - 2 * pp + r + 1):  # 4, the main phase: F0 with B1, then F1 with B0
        if i == 0 and r == pp - 1:  # the last rank: not overlapped (a smaller bubble)
            f(0)
            b(1)
        else:
            fb(0, 1)
        fb(1, 0)
    for _ in range(pp - r - 1):  # 5: B1, F1 with B0
        b(1)
        fb(1, 0)
    zb = False
    for i in range(r + 1):  # 6: B1 B0, zero bubble from half way
        if i == (r + 1) // 2 and r % 2 == 1:
            zb = True
        b(1, zb)
        if i == (r + 1) // 2 and r % 2 == 0:
            zb = True
        b(0, zb)
    for _ in range(pp - r - 1):  # 7: W B0
        w()
        b(0, zb=True)
    while queue:  # 8: the W's left
        w()
    return acts, pairs


def _zbv_pick(stages, nxt, done, t, n, m, cap):
    for s in stages:  # a B whose gradient has arrived
        i = nxt["B"][s]
        if i < nxt["F"][s] and done.get(Action("F", i, s), t + 1) <= t:
            if s == n - 1 or done.get(Action("B", i, s + 1), t + 1) <= t:
                return Action("B", i, s)
    held = sum(nxt["F"][s] - nxt["W"][s] for s in stages)
    for s in stages:  # a forward whose input has arrived, within the cap
        i = nxt["F"][s]
        if i < m and held < cap and (s == 0 or done.get(Action("F", i, s - 1), t + 1) <= t):
            return Action("F", i, s)
    for s in reversed(stages):  # the oldest pending W (the earlier stage's first)
        if nxt["W"][s] < nxt["B"][s]:
            return Action("W", nxt["W"][s], s)
    return None


def interleaved(pp: int, m: int, v: int, r: int) -> list[Action]:
    """Megatron's interleaved 1F1B over v model chunks (rank r holds stages r, r + pp, ...).

    Micro-batches go through the chunks in groups of pp, so m must be a multiple of pp.
    """
    if m % pp:
        raise PipelineError(
            f"The interleaved schedule runs micro-batches in groups of pp={pp}: "
            f"use microbatches divisible by {pp} (got {m})."
        )
    total = m * v

    def unit(k: int, forward: bool) -> Action:
        c = (k % (pp * v)) // pp
        chunk = c if forward else v - 1 - c
        mb = (k // (pp * v)) * pp + k % pp
        return Action("F" if forward else "B", mb, chunk * pp + r)

    warmup = total if m == pp else min((pp - r - 1) * 2 + (v - 1) * pp, total)
    acts = [unit(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        acts += [unit(warmup + i, True), unit(i, False)]
    acts += [unit(i, False) for i in range(total - warmup, total)]
    return acts


class Slot(NamedTuple):
    action: Action
    start: float
    end: float


def deps(kind: str, microbatch: int, stage: int, n_stages: int) -> list[tuple]:
    """What an action waits for, as (kind, micro-batch, stage): the forward of the stage before;
    for a backward, its own forward and the backward of the stage after; for a weight-gradient
    part, its own backward."""
    if kind == "W":
        return [("B", microbatch, stage)]
    if kind == "F":
        return [("F", microbatch, stage - 1)] if stage > 0 else []
    after = [("B", microbatch, stage + 1)] if stage < n_stages - 1 else []
    return [("F", microbatch, stage)] + after


def replay(schedule: list[list[Action]], n_stages: int, duration=None) -> list[list[Slot]]:
    """Start and end of every action when each runs as soon as its rank and inputs are free.

    ``duration(action)`` defaults to 1 for every action (one slot each).
    Raises PipelineError if the schedule would deadlock (an action waits on one that its
    rank can only reach later). An action's start is the latest end of its rank's previous
    action and of its inputs, whatever order the ranks are walked in: each rank runs until an
    input is missing and waits on it, and resumes when it is done (each action visited once;
    sweeping every rank until one progressed was a tenth of a 512-rank search).
    """
    duration = duration or (lambda a: 1.0)
    done: dict[tuple, float] = {}
    pos = [0] * len(schedule)
    free = [0.0] * len(schedule)
    out: list[list[Slot]] = [[] for _ in schedule]
    present = {a for acts in schedule for a in acts}  # forward-only schedules have no backwards
    waiting: dict[tuple, list[int]] = {}  # an action not run yet -> the ranks waiting on it
    ready = list(range(len(schedule)))
    while ready:
        r = ready.pop()
        acts = schedule[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            need = [d for d in deps(*a, n_stages) if d in present]
            missing = next((d for d in need if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            start = max([free[r]] + [done[d] for d in need])
            end = start + duration(a)
            done[a], free[r] = end, end
            out[r].append(Slot(a, start, end))
            pos[r] += 1
            ready += waiting.pop(a, [])
    if any(pos[r] < len(acts) for r, acts in enumerate(schedule)):
        stuck = {r: str(acts[pos[r]]) for r, acts in enumerate(schedule) if pos[r] < len(acts)}
        raise PipelineError(f"The schedule deadlocks: ranks wait at {stuck}.")
    return out


def idle_fraction(slots: list[list[Slot]]) -> list[float]:
    """Per rank: 1 - busy time / the whole step's span (first start to last end, all ranks)."""
    t0 = min(s.start for rs in slots for s in rs)
    t1 = max(s.end for rs in slots for s in rs)
    span = (t1 - t0) or 1.0
    return [1.0 - sum(s.end - s.start for s in rs) / span for rs in slots]


def theoretical_bubble(kind: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction of a balanced pipeline: (p - 1) / (m + p - 1), or (p - 1) / (v m + p - 1)
    for the interleaved schedule with v chunks; ZB-H1 with F, B and W of one slot each (m >= p):
    (p - 1) / (3m + p - 1)."""
    if kind == "zb-h1":
        return (pp - 1) / (3 * microbatches + pp - 1)
    if kind in V_SHAPED:  # what the unit-slot order leaves (no closed form: the greedy order's)
        slots = replay(build(kind, pp, microbatches), 2 * pp)
        return max(idle_fraction(slots))
    v = chunks if kind == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and backward has not (activations held; under a
    zero-bubble schedule until its W: the weights' gradients need them)."""
    held, peak = 0, 0
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak = max(peak, held)
    return peak


def table(slots: list[list[Slot]], ranks=None, pairs=None) -> str:
    """A text grid: one row per rank, one column per unit slot, cells like F3 / B0 / W0 (. = idle);
    ``pairs`` (``overlapped``'s, per rank): a forward and a backward run overlapped end in ``*``."""
    ranks = range(len(slots)) if ranks is None else ranks
    end = int(max(s.end for rs in slots for s in rs))
    lines = ["slot   " + " ".join(f"{t:>5}" for t in range(end))]
    marked = [{a for pair in p for a in pair} for p in pairs] if pairs else None
    for r in ranks:
        cells = ["    ."] * end
        for s in slots[r]:
            label = f"{s.action.kind}{s.action.microbatch}" + (f"/{s.action.stage}" if _multi(slots) else "")
            label += "*" if marked and s.action in marked[r] else ""
            for t in range(int(s.start), int(s.end)):
                cells[t] = f"{label:>5}"
        lines.append(f"rank {r:<2}" + " ".join(cells))
    if marked and any(marked):
        lines.append(
            "* a forward and another micro-batch's backward, overlapped (one runs while the other's messages travel)"
        )
    return "\n".join(lines)


def _multi(slots) -> bool:
    return any(s.action.stage >= len(slots) for rs in slots for s in rs)
