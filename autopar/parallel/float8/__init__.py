"""Float8 training (torchao's recipes) as a technique: technique.py (ap.Float8), ops.py (the
float8 matmul with its scales' reductions), rule.py (its layouts and lowering), recipes.py,
gather.py (zero=3's fp8 gathers), cost.py (its cost terms: which Linears it converts, the casts'
bytes, the scales' all-reduces; the cost model asks ``Float8.op_extras``)."""

from autopar.parallel.float8.technique import Float8

__all__ = ["Float8"]
