"""Float8 training (torchao's recipes) as a technique: technique.py (ap.Float8), ops.py (the
float8 matmul with its scales' reductions), rule.py (its layouts and lowering), recipes.py."""

from autopar.parallel.float8.technique import Float8

__all__ = ["Float8"]
