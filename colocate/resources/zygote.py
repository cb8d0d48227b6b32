"""Procs forked from a process that imported torch once (a fork server, as multiprocessing's
forkserver), for the procs a runtime starts on its own machine without GPUs: a proc then
starts in a fraction of the CPU time an interpreter spends importing torch
(bench/RESULTS.md, "A proc's start").

`address()` starts this process's fork server (`python -m colocate.resources.zygote PATH`)
on first use; it lives as long as this process (it ends when its stdin, a pipe from here,
closes). The client's is for procs on its own machine; a host's worker
(`colocate.resources.worker`) starts one for its host's procs. Monarch starts each proc as
a command (`procs.bootstrap_command`); given the server's socket in `proc_main.FORK_ENV`
(or `proc_main.HOST`: its host's), that command (`proc_main.run`) calls
`proc_main.launch`, which hands the server its stdin, stdout and stderr, its environment,
working directory, `sys.path` and argv. The server forks a child that takes them and runs
Monarch's bootstrap module as the command would have. The command stays as the child's
stand-in for whoever started it: it forwards the signals it can catch and exits as the child
exits (its exit code, or killed by its signal). If the command is killed, the server kills
its child; if the server dies, each command kills its child.

Beyond torch, the server imports what `preload` names (a vLLM engine's modules, for runs
that start one); what those imports set in the environment, each child sets too unless its
own environment does. The server imports no Monarch (each child does, after it took its own
environment), and takes OMP_NUM_THREADS out of its own environment: OpenMP reads it once,
as torch loads, so a child whose environment sets it gets it from `torch.set_num_threads`.
GPU slot procs are not forked: CUDA_VISIBLE_DEVICES and torch_memory_saver's LD_PRELOAD
must be in place when their process starts.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

from colocate.resources.proc_main import HEADER, STDIO, read_exactly, run, send_signal

FORK_PROCS_ENV = "COLOCATE_FORK_PROCS"  # "0": each proc starts on its own, never forked
PRELOAD = ("torch", "torch.distributed.tensor")  # what every proc imports, at ~2 s of CPU

_server: subprocess.Popen | None = None
_path = ""
_preloads: list[str] = []  # what `preload` asked for, in order
_set_by_imports: dict[str, str] = {}  # in the server: what the imports put in os.environ


def address() -> str:
    """The socket of this process's fork server, started on first use (and again if it
    died); it ends with this process."""
    global _server, _path
    if _server is None or _server.poll() is not None:
        _path = os.path.join(tempfile.mkdtemp(prefix="colocate-fork-"), "socket")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        _server = subprocess.Popen([sys.executable, "-m", __name__, _path, *_preloads],
                                   stdin=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(_path):  # bound as it starts, before it loads torch
            if _server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server for this process's procs did not start "
                                   f"(exit code {_server.poll()}); see its error above, or "
                                   "set COLOCATE_FORK_PROCS=0 to start each proc on its own")
            time.sleep(0.01)
    return _path


def wanted() -> bool:
    """Whether procs are to be forked where a fork server can serve them: unless
    COLOCATE_FORK_PROCS=0."""
    return os.environ.get(FORK_PROCS_ENV) != "0"


def preload(*modules: str) -> None:
    """Have this process's fork server import `modules` too, so that the procs forked from
    then on find them imported: what only some runs' procs import, at a cost worth saving
    (an engine's: `colocate.engines.actors.ENGINE_MODULES`). Call it before the runtime
    starts its procs; sent to the server now if it runs, else when it starts. A module
    that fails to import is reported by the server and left out."""
    new = [m for m in modules if m not in _preloads]
    _preloads.extend(new)
    if new and _server is not None and _server.poll() is None:
        _server.stdin.write("".join(f"{m}\n" for m in new).encode())
        _server.stdin.flush()


def server_pid() -> int | None:
    """The pid of this process's fork server while it runs (it serves every runtime this
    process starts, and outlives each)."""
    return _server.pid if _server is not None and _server.poll() is None else None


@dataclass
class _Request:
    module: str
    env: dict[str, str]
    cwd: str
    path: list[str]
    argv: list[str]
    stdio: list[int]


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket

    def close(self) -> None:
        os.close(self.pidfd)
        self.conn.close()


def main(path: str, *preloads: str) -> None:
    """The fork server, `preloads` imported after `PRELOAD`; in each forked child, the proc
    its request asked for."""
    request = _serve(path, preloads)  # returns only in a forked child
    _become(request)


def _import(modules: list[str] | tuple[str, ...]) -> None:
    """Import `modules`, keeping what their imports set in the environment for the
    children (`_set_by_imports`)."""
    before = dict(os.environ)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as err:  # the procs import it themselves, as without the server
            print(f"colocate fork server: cannot preload {module} ({err!r})", file=sys.stderr)
    _set_by_imports.update({k: v for k, v in os.environ.items() if before.get(k) != v})


def _serve(path: str, preloads: tuple[str, ...]) -> _Request:
    children: dict[int, _Child] = {}  # by the fd the selector reports: pidfd, or conn
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, \
            selectors.DefaultSelector() as selector:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends with the process that started it
        # or when told to (a job's end signals all its processes): its socket's folder goes too
        signal.signal(signal.SIGTERM, lambda *_: _end(path, children))
        listener.bind(path)
        listener.listen(64)  # requests wait here while torch loads
        _import((*PRELOAD, *preloads))
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        asked = b""  # what `preload` sent, up to its last full line
        while True:
            for key, _ in selector.select():
                if key.fileobj is sys.stdin:
                    sent = os.read(sys.stdin.fileno(), 4096)
                    if not sent:  # the process that started this one ended
                        _end(path, children)
                    *lines, asked = (asked + sent).split(b"\n")
                    _import([line.decode() for line in lines if line])
                elif key.fileobj is listener:
                    request, conn = _accept(listener)
                    if request is None:
                        continue
                    try:
                        with warnings.catch_warnings():  # Python 3.12+ warns of any thread
                            # (gh-100228); the one here is OpenBLAS's pool, which its own
                            # pthread_atfork handler stops before a fork
                            warnings.simplefilter("ignore", DeprecationWarning)
                            pid = os.fork()
                    except OSError as err:  # its command ends with an error
                        print(f"colocate fork server: cannot fork ({err})", file=sys.stderr)
                        conn.close()
                        continue
                    if pid == 0:
                        for child in _each(children):
                            child.close()
                        conn.close()
                        return request  # the with-blocks close the listener and selector
                    for fd in request.stdio:
                        os.close(fd)
                    child = _Child(pid, os.pidfd_open(pid), conn)
                    children[child.pidfd] = children[conn.fileno()] = child
                    selector.register(child.pidfd, selectors.EVENT_READ)
                    selector.register(conn, selectors.EVENT_READ)
                    conn.sendall(HEADER.pack(pid))
                elif (child := children.pop(key.fd, None)) is not None:  # it, or its command,
                    exited = key.fd == child.pidfd                        # ended
                    children.pop(child.conn.fileno() if exited else child.pidfd)
                    _finish(child, selector, exited)


def _each(children: dict[int, _Child]) -> list[_Child]:
    return list({child.pid: child for child in children.values()}.values())


def _accept(listener: socket.socket) -> tuple[_Request | None, socket.socket]:
    conn, _ = listener.accept()
    conn.settimeout(30.0)  # a command sends its request as it connects
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(conn, HEADER.size, STDIO)
        fields = json.loads(read_exactly(conn, HEADER.unpack(head)[0]))
    except (OSError, EOFError, ValueError, struct.error) as err:
        print(f"colocate fork server: a bad request ({err})", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None, conn
    conn.settimeout(None)
    return _Request(**fields, stdio=fds), conn


def _finish(child: _Child, selector: selectors.BaseSelector, exited: bool) -> None:
    """The child ended (`exited`): tell its command how; or its command ended first: kill
    the child. Either way, reap it."""
    if not exited:
        send_signal(child.pid, signal.SIGKILL)
    _, status = os.waitpid(child.pid, 0)
    if exited:
        with contextlib.suppress(OSError):
            child.conn.sendall(HEADER.pack(status))
    selector.unregister(child.pidfd)
    selector.unregister(child.conn)
    child.close()


def _end(path: str, children: dict[int, _Child]) -> None:
    """Close every command's connection (each kills its child) and exit."""
    for child in _each(children):
        child.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    os._exit(0)


def _become(request: _Request) -> None:
    """Take the command's stdio, environment, directory, path and argv, then run its module
    as `proc_main.run` would: this process then ends as a proc does."""
    for target, fd in enumerate(request.stdio):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ends on it
    os.environ.clear()
    os.environ.update(request.env)
    for key, value in _set_by_imports.items():  # as if this process had imported them
        os.environ.setdefault(key, value)
    os.chdir(request.cwd)
    sys.path[:] = request.path
    sys.argv[:] = request.argv
    if "OMP_NUM_THREADS" in request.env:
        import torch

        torch.set_num_threads(int(request.env["OMP_NUM_THREADS"]))
    run(request.module)


if __name__ == "__main__":
    main(*sys.argv[1:])
