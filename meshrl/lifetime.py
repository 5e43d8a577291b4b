"""What every process of a run does first: tie its life to the process that started it (the data plane's
servers, the zygote, the services: meshrl/runtime/supervise.py starts them with MESHRL_PARENT set)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """First thing in a child process: get SIGTERM when the process that started it dies, even by
    SIGKILL (Linux). Asked for here, after exec, and not in a pre-exec hook: Python code run between
    fork and exec in a launcher with threads (gloo, ZMQ) can deadlock on a lock another thread held at
    the fork, and Popen then waits for that child forever."""
    parent = os.environ.get("MESHRL_PARENT")
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent died before we could ask
        os.kill(os.getpid(), sig)
