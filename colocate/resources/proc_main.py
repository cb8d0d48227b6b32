"""Entry point of every proc the runtime starts (slot procs and arbiter procs): set up
what must precede Monarch's bootstrap module, then run it as `python -m` would, or have a
fork server run it in a child that this process stands in for (`launch`).

A GPU slot's proc first gets its GPU (`gpus.run_on_slot_gpu`). A proc given a fork server
(`FORK_ENV`, see `colocate.resources.zygote`) hands it what the proc would have started
with and forwards signals to the child until it ends; given `HOST`, the fork server its
host's worker started (`HOST_FORK_ENV`, inherited from the worker), where there is one.
Every proc ends without the interpreter's teardown: once Monarch's bootstrap returned,
non-daemon threads were joined and every atexit callback ran, the proc flushes its output
and exits with the bootstrap's exit code. With torch loaded, the teardown's garbage
collections are most of a proc's stop (py-spy finds the proc in `gc_collect_main` after
its actors have stopped; figures: bench/RESULTS.md, "A proc's stop"), for memory the
system takes back anyway. Freezing the heap (`gc.freeze`) would save the same time, but
nanobind then prints its leak warnings at every exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import socket
import struct
import sys

FORK_ENV = "COLOCATE_FORK_SERVER"  # the socket of a fork server to start this proc from
HOST = "host"  # FORK_ENV's value for the fork server of the proc's host, if it has one
HOST_FORK_ENV = "COLOCATE_HOST_FORK_SERVER"  # that server's socket, set by the host's worker
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
STDIO = 3  # stdin, stdout, stderr: passed to the fork server with each request
HEADER = struct.Struct("!Q")  # a request's length; an answer: a pid, then a wait status
_exit_code = 1  # what Python exits with after an uncaught exception


def run(module: str, gpu_slot: bool = False) -> None:
    """Run `module` as this proc's main module; with `gpu_slot`, on its slot's GPU; given a
    fork server (`FORK_ENV`), in a child of it that this process stands in for."""
    global _exit_code
    atexit.register(_exit_now)  # registered first, so it runs after every other callback
    fork_server = os.environ.pop(FORK_ENV, None)
    if fork_server == HOST:
        fork_server = os.environ.get(HOST_FORK_ENV)
    try:
        if fork_server and not gpu_slot:
            code = launch(fork_server, module)
            if code is not None:
                raise SystemExit(code)
        if gpu_slot:
            from colocate.resources.gpus import run_on_slot_gpu

            run_on_slot_gpu(module)
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as end:
        _exit_code = end.code if isinstance(end.code, int) else int(end.code is not None)
        raise
    _exit_code = 0


def launch(path: str, module: str) -> int | None:
    """Run `module` as this process's main module in a child of the fork server at `path`
    (`colocate.resources.zygote`), standing in for it: the signals in FORWARDED go to the
    child, and this process ends as the child does. Returns the child's exit code, or ends
    by its signal; 1 if the server took the request but started no child it named; None:
    the server cannot be reached, and nothing was started."""
    request = json.dumps({"module": module, "env": dict(os.environ), "cwd": os.getcwd(),
                          "path": sys.path, "argv": sys.argv}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as err:
        print(f"colocate: no fork server at {path} ({err}): this proc starts on its own",
              file=sys.stderr)
        return None
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # held until the child has them
    try:
        socket.send_fds(conn, [HEADER.pack(len(request))], list(range(STDIO)))
        conn.sendall(request)
        child = _read_number(conn)
    except (EOFError, OSError) as err:  # it could not fork, or died: was a child started?
        print(f"colocate: the fork server at {path} did not start this proc ({err}); "
              "COLOCATE_FORK_PROCS=0 starts each proc on its own", file=sys.stderr)
        return 1
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: send_signal(child, sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    try:
        status = _read_number(conn)
    except (EOFError, ConnectionError):  # the server died: no one is left to watch the child
        send_signal(child, signal.SIGKILL)
        print(f"colocate: the fork server of proc {child} ended; proc killed", file=sys.stderr)
        return 1
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: so is its stand-in
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to end the process
    return code


def send_signal(pid: int, sig: int) -> None:
    """`sig` to `pid`, unless it has ended already."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def read_exactly(conn: socket.socket, size: int) -> bytes:
    """`size` bytes from `conn`; EOFError if the other end closes first."""
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed the connection")
        data += chunk
    return data


def _read_number(conn: socket.socket) -> int:
    return HEADER.unpack(read_exactly(conn, HEADER.size))[0]


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a broken pipe: exit all the same
            stream.flush()
    os._exit(_exit_code)
