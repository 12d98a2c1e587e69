"""The messages of a pipeline schedule, and when a sender may let go of what it sent.

A stage's forward sends each boundary value it makes to the stages that read it; a stage's
backward sends the gradient of each float value it received back to its producer. A sent
tensor must stay alive until the receiver has it (torch.distributed's isend reads the tensor
while it travels). Waiting for every send only at the end of a step (as the runner did) keeps
every micro-batch's sent activations and gradients alive for the whole step: on 4 gloo ranks
that was 34-74% of what a ``Pipeline(checkpoint=True)`` rank held, and it grows with the
micro-batch count, which 1F1B is meant not to.

``releases`` finds, from the schedule alone, the first of the sender's own actions after which
the message has surely arrived: an action that receives a message its receiver sent at or after
the action that consumed it (the receiver waited for ours before it sent that one). The runner
waits for the send there (it has completed: nothing blocks) and drops it; the memory model
(stage_memory.py) counts the sent tensor alive until that action. A message with no such
later action is waited for at the end of the step. Messages to the rank itself (two chunks of
one rank) are copies handed over in process, not pending sends.

Pure Python (no torch): the runner and the cost model share it.

Example:
    >>> acts = schedules.build("1f1b", layout.pp, 4)
    >>> releases(layout, acts, 0)    # {action index: [Message, ...] known received after it}
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.parallel.pipeline.schedules import Action

# The runner posts the receives of the current action and this many after it. A receive posted
# after its message was sent costs a round trip through gloo's threads (the send waits for the
# receiver's notice). bench/bench_pipeline_overhead.py's 1F1B p=2 m=8, 10 steps, receives posted
# after their send (CLOCK_MONOTONIC on both ranks): 23 of 160 one action ahead, 9 at two, 4 at
# four, 5 with the whole step's posted at its start, 2 for the hand-written pipeline (which
# posts them all). Four bounds the buffers posted ahead to four actions' messages.
PREFETCH_AHEAD = 4


@dataclass(frozen=True)
class Message:
    """Boundary value ``value`` of micro-batch ``microbatch``, made by stage ``producer`` and read
    by stage ``consumer``; ``direction`` 0 goes forward (the value), 1 backward (its gradient)."""

    value: str
    microbatch: int
    producer: int
    consumer: int
    direction: int

    @property
    def src(self) -> int:
        """The stage that sends it."""
        return self.consumer if self.direction else self.producer

    @property
    def dst(self) -> int:
        """The stage that receives it."""
        return self.producer if self.direction else self.consumer


def sent(layout, a: Action) -> list[Message]:
    """The messages action ``a`` sends (in the runner's order; a weight-gradient part "W": none)."""
    st = layout.stages[a.stage]
    if a.kind == "W":
        return []
    if a.kind == "F":
        return [Message(name, a.microbatch, a.stage, d, 0) for name, dsts in st.send for d in dsts]
    return [Message(name, a.microbatch, src, a.stage, 1) for name, src in st.recv if layout.kinds[name] == "grad"]


def received(layout, a: Action) -> list[Message]:
    """The messages action ``a`` receives (a weight-gradient part "W": none)."""
    st = layout.stages[a.stage]
    if a.kind == "W":
        return []
    if a.kind == "F":
        return [Message(name, a.microbatch, src, a.stage, 0) for name, src in st.recv]
    return [
        Message(name, a.microbatch, a.stage, d, 1)
        for name, dsts in st.send
        if layout.kinds[name] == "grad"
        for d in dsts
    ]


def consumer_action(m: Message) -> Action:
    """The action that receives ``m``."""
    return Action("B" if m.direction else "F", m.microbatch, m.dst)


def sender_action(m: Message) -> Action:
    """The action that sends ``m``."""
    return Action("B" if m.direction else "F", m.microbatch, m.src)


def releases(layout, schedule: list[list[Action]], pos: int) -> dict[int, list[Message]]:
    """Action index on pipeline position ``pos`` -> the messages ``pos`` sent to another position
    that are known received once that action has run (it received a message that their receiver
    sent after consuming them). Messages never listed are waited for at the end of the step."""
    where = [{a: i for i, a in enumerate(acts)} for acts in schedule]
    acts = schedule[pos]
    # for each later action of ours: (sender position, the sender's action index) of what it receives
    heard = [
        [(layout.rank_of_stage(m.src), where[layout.rank_of_stage(m.src)].get(sender_action(m), -1))
         for m in received(layout, a)]
        for a in acts
    ]  # fmt: skip
    out: dict[int, list[Message]] = {}
    for i, a in enumerate(acts):
        for m in sent(layout, a):
            q = layout.rank_of_stage(m.dst)
            consumed = where[q].get(consumer_action(m))
            if q == pos or consumed is None:
                continue
            for j in range(i + 1, len(acts)):
                if any(src == q and at >= consumed for src, at in heard[j]):
                    out.setdefault(j, []).append(m)
                    break
    return out


def posted_at(layout, acts: list[Action], pos: int) -> list[tuple[int, int, Message]]:
    """(action index the runner posts its receive at, the index of the action that takes it, the
    message) for each message ``pos`` receives from another position through a buffer posted
    ahead: at the start of action i the runner posts the receives of actions i .. i +
    PREFETCH_AHEAD. This is a step after the first with these input shapes: the runner's channel
    knows every stream's shape from then on (the first step receives each stream's first message
    with its header, when asked, so it holds at most this much)."""
    out = []
    for t, a in enumerate(acts):
        for m in received(layout, a):
            if layout.rank_of_stage(m.src) != pos:
                out.append((max(t - PREFETCH_AHEAD, 0), t, m))
    return out


def stream(layout, m: Message) -> tuple:
    """A message's stream (its sending position, value, consumer stage and direction), whose
    messages have one shape a step (the runner's, parallel/pipeline/p2p.py)."""
    return layout.rank_of_stage(m.src), m.value, m.consumer, m.direction
