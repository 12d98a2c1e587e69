"""Lowerings: ops whose sharded form is not the same op on local pieces (vocabulary-parallel cross-entropy, ...)."""
