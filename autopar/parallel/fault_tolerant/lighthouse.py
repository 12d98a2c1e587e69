"""The torchft lighthouse, in a process of its own: it agrees each step's quorum of replica groups.

torchft ships the server in its wheel (``torchft._torchft.LighthouseServer``); running it in a
separate process lets it outlive (and be killed apart from) any training job, as in a real
deployment. ``start_lighthouse`` starts one on a free port and returns its address;
``python -m autopar.parallel.fault_tolerant.lighthouse`` runs one in the foreground.

``join_timeout_ms``: how long a quorum waits for groups of the last quorum that have not asked
yet (a group that restarts is back within it); ``heartbeat_timeout_ms``: how long a group may be
silent before it counts as lost (torchft's default is 5000; a smaller one notices a lost group
sooner, at the cost of false alarms under load).

Example:
    >>> lh = start_lighthouse(min_replicas=1)
    >>> lh.address
    'http://myhost:41237'
    >>> lh.stop()
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from autopar.errors import FaultToleranceError


class Lighthouse:
    """A running lighthouse process: ``address`` to give ap.FaultTolerant, ``stop()`` to end it."""

    def __init__(self, process: subprocess.Popen, address: str):
        self.process, self.address = process, address

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_lighthouse(
    min_replicas: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000, port: int = 0, log=None
) -> Lighthouse:
    """Start a lighthouse process on ``port`` (0: a free one) of this host; returns once it serves.
    ``log``: where its quorum log goes (a file, subprocess.DEVNULL; None: this process' stderr)."""
    args = f"{min_replicas}, {join_timeout_ms}, {heartbeat_timeout_ms}, {port}"
    code = f"{_SERVE}\nserve({args})"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True)
    line = process.stdout.readline()  # its address, once it listens
    if not line.startswith("http"):
        process.kill()
        raise FaultToleranceError(f"the torchft lighthouse did not start (it printed {line!r}); is torchft installed?")
    return Lighthouse(process, line.strip())


# Run in the lighthouse's process: torchft's server module loaded from its file, without importing
# torchft's package (torch and all: seconds) or autopar: the lighthouse is up in ~50 ms.
_SERVE = """
import glob, importlib.machinery, importlib.util, os, time

def serve(min_replicas, join_timeout_ms, heartbeat_timeout_ms, port):
    folder = os.path.dirname(importlib.util.find_spec("torchft").origin)
    path = glob.glob(os.path.join(folder, "_torchft*.so"))[0]
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
    native = importlib.util.module_from_spec(importlib.util.spec_from_loader("torchft._torchft", loader))
    loader.exec_module(native)
    server = native.LighthouseServer(
        bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    print(server.address(), flush=True)
    while True:
        time.sleep(3600)
"""


def main(argv=None) -> None:
    """``python -m autopar.parallel.fault_tolerant.lighthouse --min-replicas 1``: serve until killed."""
    parser = argparse.ArgumentParser(description="Run a torchft lighthouse; prints its address.")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--join-timeout-ms", type=int, default=1000)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    parser.add_argument("--port", type=int, default=29510)
    args = parser.parse_args(argv)
    scope: dict = {}
    exec(_SERVE, scope)  # the same code start_lighthouse runs in its process
    scope["serve"](args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms, args.port)


if __name__ == "__main__":
    main()
