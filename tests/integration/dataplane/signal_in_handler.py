"""`meshrl queue serve` that sends itself a second SIGTERM from inside the handler of the first.

`python signal_in_handler.py SERVE_ARGS...`. A profile hook on the main thread follows the SIGTERM
handler: each time a call into C returns inside it (a lock just taken, say), and when it returns, the
process signals itself again, so the second signal arrives while the first handler still runs, every
time, not by luck of timing. A handler that holds a lock there then waits for itself forever (as
`threading.Event.set` did). Each signal sent is reported on stderr.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

from meshrl.dataplane import serve


def hook(frame: FrameType, event: str, arg: Any) -> None:
    if event not in ("c_return", "return"):
        return
    code = getattr(signal.getsignal(signal.SIGTERM), "__code__", None)
    depth = 0
    f: FrameType | None = frame
    while f is not None:
        depth += f.f_code is code
        f = f.f_back
    if depth == 1:  # in the first handler, not in one this hook started
        print(f"second SIGTERM sent inside the handler ({event})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.setprofile(hook)
    serve.main(sys.argv[1:])
