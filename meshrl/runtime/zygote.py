"""A warm parent for service processes: torch, transformers and the services' modules are imported once
per launch, and every service process is forked from that parent.

Importing torch and transformers costs seconds of CPU per process, and a run starts several service
processes on few cores: started each with an interpreter of its own, they spent most of a run's
start-up importing the same modules side by side. A launcher starts one zygote at the beginning of a
launch; the zygote imports what its services need while the data plane starts, then forks each service
on request. A forked child starts with those modules loaded (and shares their pages with its siblings).

The zygote stays single-threaded, so that a fork never copies a lock another thread held: it imports
modules and reads model configs (no tensor math, which would start torch's thread pools; OpenBLAS adds a
thread unless OMP_NUM_THREADS=1, which `meshrl run` sets) and answers its launcher from one loop. The
launcher talks to it over a socket pair, one JSON object per line:

    launcher -> zygote   {"spawn": NAME, "argv": [...], "env": {...}, "log": PATH}
                         {"sweep": [DIRECTORY, PREFIX]}    files to remove when the zygote ends
    zygote -> launcher   {"pid": PID, "name": NAME}  or  {"error": TEXT, "name": NAME}
                         {"exit": PID, "code": CODE}        CODE as Popen.returncode (-N: killed by signal N)

A child becomes `python -m meshrl.runtime.worker ARGV...` as if started afresh: its own session, its log
as stdout and stderr, exactly the environment it was given, the signal and logging set-up and torch's
random state of a new interpreter, and SIGTERM when the zygote dies. The zygote ends when its launcher
closes the socket or on SIGTERM (its launcher died: the kernel sends it): it stops the children left
(SIGTERM, SIGKILL after a grace period), removes the files it was told to sweep and exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshrl.lifetime import die_with_parent
from meshrl.runtime.supervise import Child, signal_group, sweep

GRACE_S = 10.0  # SIGTERM to SIGKILL, for children still running when the zygote ends


# -------------------------------------------------------------------------------------------------------
# the zygote process


def main(argv: list[str] | None = None) -> None:
    """`python -m meshrl.runtime.zygote FD [--module M ...] [--model PATH ...]`: import the modules and
    the modeling code of the models, then serve the launcher on socket FD."""
    die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    modules = [args[i + 1] for i in range(1, len(args) - 1) if args[i] == "--module"]
    models = [args[i + 1] for i in range(1, len(args) - 1) if args[i] == "--model"]
    zygote = Zygote(sock)  # its signal handlers first: SIGTERM during the imports ends it too
    t0 = time.monotonic()
    try:
        preload(modules, models)
    except _Ending:
        zygote.end()
    threads = len(os.listdir("/proc/self/task"))
    _log(f"imported {len(modules)} modules and {len(models)} model classes in {time.monotonic() - t0:.1f}s")
    if threads != 1:
        _log(
            f"warning: {threads} threads after the imports (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
        )
    # what the children inherit stays out of their garbage collector's passes, which would otherwise
    # touch (and so copy) its pages in every child: half the memory of a run, a faster start
    gc.freeze()
    zygote.serve()


def preload(modules: list[str], models: list[str]) -> None:
    """Import torch, `modules`, and the modeling module of each model directory's architecture."""
    import torch

    import meshrl.runtime.worker  # noqa: F401

    # an optimisation only: what fails here fails again in the service, which reports it as its failure
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:
            _log(f"not preloading {name}: {type(e).__name__}: {e}")
    for path in models:
        try:
            _import_model_code(path)
        except Exception as e:
            _log(f"not preloading the model code of {path}: {type(e).__name__}: {e}")
    if torch.cuda.is_initialized():  # a forked child could not use the GPU
        raise RuntimeError("CUDA was initialised while importing the services' modules")


def _import_model_code(path: str) -> None:
    if not (Path(path) / "config.json").is_file():
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(AutoConfig.from_pretrained(path).model_type)
    importlib.import_module(f"transformers.models.{module}.modeling_{module}")


class _Ending(BaseException):
    """SIGTERM while the zygote imports: stop importing."""


class Zygote:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.children: dict[int, str] = {}
        self.sweeps: list[tuple[str, str]] = []
        self.serving = False
        self.ending = False
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the wakeup fd
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle

    def _on_term(self, *_: Any) -> None:
        self.ending = True
        if not self.serving:
            raise _Ending

    def serve(self) -> None:
        self.serving = True
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(self.wake_r, selectors.EVENT_READ)
        while not self.ending:
            for key, _ in sel.select(timeout=1.0):
                if key.fileobj is self.sock:
                    self.ending |= not self._read()
                else:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
            self._reap()
        self.end()

    def end(self) -> None:
        """Stop the children left, then sweep (what the launcher asked for, if it is gone too)."""
        self.serving, self.ending = True, True
        self._stop_children()
        self.sock.setblocking(False)
        with contextlib.suppress(OSError):
            self._read()  # sweep requests not read yet (ending during the imports)
        for directory, prefix in self.sweeps:
            sweep(directory, prefix)
        sys.stderr.flush()
        os._exit(0)

    def _read(self) -> bool:
        try:
            data = self.sock.recv(1 << 16)
        except ConnectionError:
            return False
        if not data:
            return False
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            request = json.loads(line)
            if "spawn" in request and not self.ending:
                self._spawn(request)
            if "sweep" in request:
                directory, prefix = request["sweep"]
                self.sweeps.append((str(directory), str(prefix)))
        return True

    def _send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the launcher is gone: the loop ends on its EOF
            self.sock.sendall(json.dumps(message).encode() + b"\n")

    def _spawn(self, request: dict[str, Any]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            self._send({"error": f"fork failed: {e}", "name": request["spawn"]})
            return
        if pid == 0:
            _child(self, request, me)  # never returns
        self.children[pid] = str(request["spawn"])
        self._send({"pid": pid, "name": request["spawn"]})

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.pop(pid, None)
            self._send({"exit": pid, "code": _returncode(status)})

    def _stop_children(self) -> None:
        for pid in self.children:
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while self.children and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        for pid in self.children:
            signal_group(pid, signal.SIGKILL)
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return
            self.children.pop(pid, None)
            self._send({"exit": pid, "code": _returncode(status)})


def _child(zygote: Zygote, request: dict[str, Any], parent: int) -> None:
    """In the forked child: become the service process `python -m meshrl.runtime.worker ARGV...`."""
    code = 1
    try:
        with contextlib.suppress(OSError, AttributeError):  # first: the zygote may die any moment now
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        zygote.sock.close()
        os.close(zygote.wake_r)
        os.close(zygote.wake_w)
        _redirect(request["log"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["MESHRL_PARENT"] = str(parent)  # the worker checks it is still there
        for handler in list(logging.root.handlers):  # the worker configures logging itself
            logging.root.removeHandler(handler)
        _fresh_random_state()
        from meshrl.runtime import worker

        sys.argv = [worker.__file__, *request["argv"]]
        worker.main(list(request["argv"]))
        code = 0
    except SystemExit as e:  # as the interpreter reports it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:  # never back into the zygote's loop
        with contextlib.suppress(BaseException):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _redirect(log: str) -> None:
    """stdin from /dev/null, stdout and stderr appended to `log` (sys.stdout and sys.stderr write
    through: the launcher starts the zygote with PYTHONUNBUFFERED)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _fresh_random_state() -> None:
    """Random generators as a new interpreter has them, not the zygote's stream shared with every sibling:
    torch's CPU generator and numpy's global one seeded afresh from the OS (as at start-up; CUDA's are
    not created before a child uses them; Python's `random` is re-seeded in a forked child by the
    interpreter itself). Runs that repeat bit for bit seed their generators themselves."""
    import torch

    torch.default_generator.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} zygote {os.getpid()}: {text}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------------
# the launcher's side


class ZygoteDied(RuntimeError):
    """The zygote ended before it could start a service (its log says why)."""


class Forker:
    """A launcher's handle on its zygote: start it, have it fork service processes, learn their exits."""

    def __init__(
        self,
        log_path: Path,
        env: dict[str, str],
        modules: list[str],
        models: list[str],
        check: Callable[[], None] = lambda: None,
    ) -> None:
        """`check` runs while the launcher waits for the zygote (it raises to give up: interrupted)."""
        ours, theirs = socket.socketpair()
        self.check = check
        self.sock = ours
        self.buffer = b""
        self.exits: dict[int, int] = {}
        self.replies: list[dict[str, Any]] = []
        self.closed = False
        argv = [sys.executable, "-m", "meshrl.runtime.zygote", str(theirs.fileno())]
        argv += [x for m in modules for x in ("--module", m)] + [x for p in models for x in ("--model", p)]
        self.process = Child("zygote", argv, log_path, env, pass_fds=(theirs.fileno(),))
        try:
            self.process.start()
        finally:
            theirs.close()
        self.sock.setblocking(False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def died(self) -> bool:
        """Whether the zygote has died. Once its socket has closed it is dying: its own exit may show a
        moment after its children's (SIGKILLed as it dies), so this waits for it (up to 5 s)."""
        if self.closed and self.process.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.proc.wait(timeout=5)
        return self.process.poll() is not None

    def spawn(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> int:
        """Fork service `name` (waits for the zygote's imports the first time); returns its pid."""
        self._write({"spawn": name, "argv": argv, "env": env, "log": str(log)})
        while True:
            for reply in self.replies:
                if reply.get("name") == name:
                    self.replies.remove(reply)
                    if "error" in reply:
                        raise RuntimeError(f"the zygote could not start {name}: {reply['error']}")
                    return int(reply["pid"])
            self.check()
            if not self._drain(wait=0.1) and self.process.poll() is not None:
                raise ZygoteDied(f"the zygote exited with code {self.process.poll()} before starting {name}")

    def returncode(self, pid: int) -> int | None:
        """The exit code of child `pid`, None while it runs. A child of a zygote that died is reported
        gone (-SIGKILL) once it no longer exists."""
        self._drain(wait=0)
        if pid in self.exits:
            return self.exits[pid]
        if self.closed and not _exists(pid):
            return -signal.SIGKILL
        return None

    def sweep(self, directory: str, prefix: str) -> None:
        """Have the zygote remove `directory/prefix*` when it ends (its launcher may die first)."""
        self._write({"sweep": [directory, prefix]})

    def stop(self) -> None:
        """End the zygote (it stops any child left, reporting their exits) and close the socket."""
        self.process.stop(grace=GRACE_S + 5)
        self._drain(wait=0)  # the exits it reported on its way out
        self.closed = True
        self.sock.close()

    def _write(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        try:
            self.sock.setblocking(True)
            self.sock.sendall(data)
        except OSError as e:
            raise ZygoteDied(f"the zygote (pid {self.pid}) is gone: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                self.sock.setblocking(False)

    def _drain(self, wait: float) -> bool:
        """Read what the zygote sent (waiting up to `wait` seconds for something); False at its end."""
        if self.closed:
            return False
        if wait:
            sel = selectors.DefaultSelector()
            sel.register(self.sock, selectors.EVENT_READ)
            sel.select(wait)
            sel.close()
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return False
            self.buffer += data
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    self.exits[int(message["exit"])] = int(message["code"])
                else:
                    self.replies.append(message)


def _exists(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    main()
