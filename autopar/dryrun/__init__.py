"""Dry runs: rank programs at full size on fake tensors in a fake world (run.py)."""
