"""held(model): named_parameters/named_modules walked once inside, the walk outside and under released()."""

from __future__ import annotations

from torch import nn

from autopar.trace.model_members import held, named_modules, named_parameters, released


def test_held_walks_once_and_only_for_its_model(monkeypatch):
    model, other = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), nn.Linear(4, 4)
    calls = []
    walk = nn.Module.named_parameters

    def counted(self, *a, **k):
        calls.append(self)
        return walk(self, *a, **k)

    monkeypatch.setattr(nn.Module, "named_parameters", counted)
    with held(model):
        first = named_parameters(model)
        assert named_parameters(model) is first
        assert [n for n, _ in named_modules(model)] == ["", "0", "1"]
        assert [n for n, _ in named_parameters(other)] == ["weight", "bias"]  # not held: walked
        with released():
            named_parameters(model)  # tracing swaps modules: walked again
    assert calls == [model, other, model]
    assert [n for n, _ in first] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    named_parameters(model)  # after the block: the walk
    assert len(calls) == 4
