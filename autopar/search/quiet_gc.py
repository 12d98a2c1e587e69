"""The objects alive when the search starts, left out of the garbage collector's passes during it.

The search plans ~40 probes on one trace: each allocates tens of thousands of short-lived
objects (layouts, keys, formulas), and every collection of the older generations walked the
whole heap as well, the trace and the model included (a 126-block graph, its metadata, its
parameters): about a second of a 512-rank search went to the collector. ``gc.freeze()`` moves
what is alive now to a generation no pass walks; ``gc.unfreeze()`` puts it back after. Nothing
is freed later than it would be by reference counting; a cycle that becomes garbage among the
frozen objects during the search is collected after it. When the process has frozen objects of
its own (a server that forks workers freezes its heap first), nothing is done: unfreezing
would also release theirs.

Example:
    >>> with quiet_gc():
    ...     annotations, chosen, record = search(...)
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def quiet_gc():
    """Within the block, the collector walks only objects made inside it."""
    if gc.get_freeze_count():
        yield  # someone else's frozen heap: leave it as it is
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
