"""Float8 training (torchao recipes) as a technique: see technique.py."""
