"""A progress line for steps that may take more than a couple of seconds.

Nothing is printed for a step that finishes quickly; one that is still running after
``after`` seconds prints "autopar: <what>..." and, when it ends, how long it took.

Example:
    >>> with progress("planning GPT on Mesh(dp=2, tp=2)"):
    ...     plan = ap.plan(...)
    autopar: planning GPT on Mesh(dp=2, tp=2)... done in 4.1 s
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time


@contextlib.contextmanager
def progress(what: str, after: float = 1.5, stream=None):
    stream = stream or sys.stderr
    shown = threading.Event()

    def show():
        shown.set()
        print(f"autopar: {what}...", end="", file=stream, flush=True)

    timer = threading.Timer(after, show)
    timer.daemon = True
    start = time.perf_counter()
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f" done in {time.perf_counter() - start:.1f} s", file=stream, flush=True)
