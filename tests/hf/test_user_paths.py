"""Issue 32's user paths on HuggingFace models: the input guard on a causal LM's ids and labels."""

from __future__ import annotations

import pytest

import autopar as ap
from tests.harness.hf_models import inputs, llama


def test_global_ids_with_local_labels_is_an_input_error():
    """Export gives a causal LM's ids and labels separate batch symbols (only their flattened
    products meet, in the loss): the guard still refuses global ids with local labels, naming
    the input, before HF's own ValueError from inside the forward."""
    kw = inputs("llama")
    plan = ap.plan(llama(), ap.Mesh((2,), ("dp",)), kwargs=kw, data_parallel="dp")
    _, local = plan.local_inputs(1, **kw)
    with pytest.raises(ap.InputError, match=r"input 'labels'.*the batch.*means a global size 4.*'input_ids' means 8"):
        plan.module(1)(input_ids=kw["input_ids"], labels=local["labels"])
    losses = plan.simulate(lambda module, **k: module(**k).loss.item(), **kw)
    assert losses[0] == pytest.approx(plan.model(**kw).loss.item(), rel=1e-5)
