"""Hosts through torchx: `start_hosts("torchx:<scheduler>", n)` and `dryrun_torchx`.

A torchx AppDef with one role ``hosts`` of N replicas, each running
``python -m colocate.resources.worker`` (see ``worker.py``), submitted with
``torchx.runner.get_runner().run(app, scheduler, cfg)``; the client then calls
``attach_to_workers(ca="trust_all_connections", workers=[...])``.

* ``local_cwd``: replica i serves ``tcp://127.0.0.1:(P + i)``, P a base port found free by
  binding, passed as ``--host 127.0.0.1 --port-base P --replica-id ${replica_id}``; the
  workers also exit when this process dies (``--parent-pid``). Their logs go to a temporary
  ``log_dir`` removed by ``stop()`` (kept if they fail to start, or when ``log_dir=`` is
  given).
* cluster schedulers (``slurm``, ``kubernetes``, ...): as Monarch's ``serve()``: every replica
  serves ``tcp://<its FQDN>:26600`` and the client dials ``tcp://<replica hostname>:26600``
  with the host names from ``runner.status(handle)``; the client's transport is set to
  ``ChannelTransport.TcpWithHostname`` (process-wide) so the workers can reach it.

Each worker carries a service identity (MONARCH_SERVICE_PROC_IDS + MONARCH_SERVICE_PROC_RANK
= ``${replica_id}``), as Monarch's own launchers give theirs. Options name the image
(``image=``), the role's ``resource=`` (a ``torchx.specs.Resource`` or a named resource),
extra ``env=``, the worker ``port=``; every other option is torchx scheduler config (e.g.
``partition=`` for slurm, ``queue=``/``namespace=`` for kubernetes, ``log_dir=`` for
local_cwd). ``stop()`` shuts the mesh down, then ``runner.cancel(handle)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from colocate.resources.host_job import HostJob, HostStartError, wait_initialized

if TYPE_CHECKING:
    from monarch.actor import HostMesh

logger = logging.getLogger(__name__)

WORKER_MODULE = "colocate.resources.worker"
ROLE_NAME = "hosts"
CLUSTER_PORT = 26600  # as Monarch's serve()


def start_torchx(name: str, n: int, timeout_s: float, port: int | None = None,
                 **options: Any) -> HostJob:
    """Submit the app on torchx scheduler `name` and return its hosts once they answer."""
    return TorchxLaunch(name, n, port, options).start(timeout_s)


def dryrun_torchx(scheduler: str, hosts: int, **options: Any) -> Any:
    """torchx's AppDryRunInfo for `hosts` hosts on `scheduler` ("slurm", "kubernetes", or
    "torchx:slurm"...), built as ``start_hosts`` builds it; nothing is submitted.
    ``str()`` of it is the request (e.g. the sbatch script, the Volcano job)."""
    from torchx.runner import get_runner

    name = scheduler.removeprefix("torchx:")
    app, cfg, _ = _torchx_app(name, hosts, port=options.pop("port", None), **options)
    with _keep_signal_handlers(), get_runner() as runner:
        return runner.dryrun(app, name, cfg=cfg)


class TorchxLaunch:
    """One submitted torchx app of `n` worker replicas: submit it, wait until its hosts
    listen and answer, and cancel it (removing the logs it made) when they do not, or when
    the HostJob stops."""

    def __init__(self, name: str, n: int, port: int | None, options: dict[str, Any]) -> None:
        self.name, self.n = name, n
        self.scheduler = f"torchx:{name}"
        self.local = name == "local_cwd"
        self.own_logs = self.local and "log_dir" not in options  # a temporary log_dir
        if self.local:
            port = port if port is not None else _free_port_base(n)
            if self.own_logs:
                options["log_dir"] = tempfile.mkdtemp(prefix="colocate_hosts_")
        self.app, self.cfg, self.proc_ids = _torchx_app(name, n, port=port, **options)
        self.port = port if port is not None else CLUSTER_PORT
        self.handle = ""
        self.logs = ""

    def start(self, timeout_s: float) -> HostJob:
        from torchx.runner import get_runner
        from torchx.specs import parse_app_handle

        deadline = time.monotonic() + timeout_s
        self.runner = get_runner()
        try:
            with _keep_signal_handlers():  # torchx's local scheduler installs its own
                self.handle = self.runner.run(self.app, self.name, cfg=self.cfg)
        except BaseException:
            self.runner.close()
            self._remove_logs()
            raise
        _, session, app_id = parse_app_handle(self.handle)
        self.logs = (os.path.join(str(self.cfg["log_dir"]), session, app_id, ROLE_NAME)
                     if self.local else f"`torchx log {self.handle}`")
        try:
            hostnames = ["127.0.0.1"] * self.n if self.local else self._hostnames(deadline,
                                                                                  timeout_s)
            ports = [self.port + i for i in range(self.n)] if self.local else [self.port] * self.n
            while not all(_listening(h, p) for h, p in zip(hostnames, ports, strict=True)):
                self._check_running("the app ended before its hosts listened")
                if time.monotonic() > deadline:
                    raise self._error(f"hosts not listening after {timeout_s:.0f} s")
                time.sleep(0.1)
            mesh = _attach(self.name, hostnames, ports, self.proc_ids)
            wait_initialized(mesh, max(deadline - time.monotonic(), 1.0), self.scheduler,
                             self.logs, self.handle, self._check_running)
        except BaseException:
            self.cancel()
            raise
        logger.info("%s: %d hosts up (app %s)", self.scheduler, self.n, self.handle)
        return HostJob(mesh, self.scheduler, self.n, handle=self.handle, logs=self.logs,
                       _kill=lambda: self.cancel(remove_logs=True))

    def _hostnames(self, deadline: float, timeout_s: float) -> list[str]:
        """A cluster's replicas' host names, from torchx once all run (as in serve())."""
        from torchx.specs import AppState

        while True:
            status = self._check_running()
            replicas = sorted(status.roles[0].replicas, key=lambda r: r.id) if status.roles else []
            if status.state == AppState.RUNNING and len(replicas) == self.n and all(
                r.state == AppState.RUNNING for r in replicas
            ):
                hostnames = [r.hostname for r in replicas]
                if not all(hostnames):
                    raise self._error(
                        "torchx reports no host names for the running replicas (torchx 0.7.0 "
                        "does not for slurm/kubernetes; torchx-nightly does); pass a Monarch "
                        "SlurmJob/KubernetesJob instead"
                    )
                return hostnames
            if time.monotonic() > deadline:
                raise self._error(f"not running after {timeout_s:.0f} s ({status.state})")
            time.sleep(1.0)

    def _error(self, why: str) -> HostStartError:
        return HostStartError(f"{self.scheduler}: {why} (app {self.handle}; worker logs: "
                              f"{self.logs})", handle=self.handle, logs=self.logs)

    def _check_running(self, why: str = "the app ended before its hosts came up") -> Any:
        """The app's torchx status; raises HostStartError once it has ended."""
        status = self.runner.status(self.handle)
        if status is None or status.is_terminal():
            raise self._error(f"{why}: {status and status.state}")
        return status

    def cancel(self, remove_logs: bool = False) -> None:
        """Cancel the app and wait (up to 30 s) until torchx says it ended; the temporary
        logs are removed only when asked (a failed start keeps them)."""
        try:
            self.runner.cancel(self.handle)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                status = self.runner.status(self.handle)
                if status is None or status.is_terminal():
                    break
                time.sleep(0.2)
        finally:
            self.runner.close()
            if remove_logs:
                self._remove_logs()

    def _remove_logs(self) -> None:
        if self.own_logs:
            shutil.rmtree(str(self.cfg["log_dir"]), ignore_errors=True)


def _torchx_app(name: str, n: int, *, port: int | None, image: str | None = None,
                resource: Any = None, env: dict[str, str] | None = None,
                **cfg: Any) -> tuple[Any, dict[str, Any], list[Any]]:
    """The AppDef (one role of `n` replicas of the worker), its torchx cfg, and the replicas'
    service ProcIds. Shared by start_hosts and dryrun_torchx."""
    from monarch.job import (
        SERVICE_PROC_IDS_ENV,
        SERVICE_PROC_RANK_ENV,
        new_service_proc_id,
        serialize_service_proc_ids,
    )
    from torchx import specs

    if n < 1:
        raise ValueError(f"hosts must be >= 1, got {n}")
    proc_ids = [new_service_proc_id() for _ in range(n)]
    role_env = {
        SERVICE_PROC_IDS_ENV: serialize_service_proc_ids(proc_ids),
        SERVICE_PROC_RANK_ENV: specs.macros.replica_id,
        **(env or {}),
    }
    if name == "kubernetes" and image is None:
        raise ValueError("kubernetes needs image=: a container image with this project in it")
    if name == "local_cwd":
        entrypoint = sys.executable
        if port is None:
            port = _free_port_base(n)
        args = ["-m", WORKER_MODULE, "--host", "127.0.0.1", "--port-base", str(port),
                "--replica-id", specs.macros.replica_id, "--parent-pid", str(os.getpid())]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        role_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p
        )
    else:
        entrypoint = "python"
        args = ["-m", WORKER_MODULE, "--port-base", str(port or CLUSTER_PORT)]
    if isinstance(resource, str):
        resource = specs.resource(h=resource)
    role = specs.Role(
        name=ROLE_NAME,
        image=image if image is not None else os.getcwd(),
        entrypoint=entrypoint,
        args=args,
        env=role_env,
        num_replicas=n,
        resource=resource if resource is not None else specs.NULL_RESOURCE,
    )
    return specs.AppDef(name="colocate-hosts", roles=[role]), cfg, proc_ids


def _attach(name: str, hostnames: list[str], ports: list[int], proc_ids: list[Any]) -> HostMesh:
    from monarch.actor import attach_to_workers
    from monarch.job import service_proc_addrs

    if name != "local_cwd":  # as Monarch's serve()/SlurmJob: a transport workers can dial
        from monarch.actor import ChannelTransport
        from monarch.config import configure

        configure(default_transport=ChannelTransport.TcpWithHostname)
    addrs = [f"tcp://{h}:{p}" for h, p in zip(hostnames, ports, strict=True)]
    return attach_to_workers(
        ca="trust_all_connections", workers=service_proc_addrs(addrs, proc_ids)
    )


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _free_port_base(n: int, tries: int = 200) -> int:
    """A base port P with P..P+n-1 all free on 127.0.0.1 (below Linux's ephemeral range)."""
    for _ in range(tries):
        base = random.randrange(20000, 32000 - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise HostStartError(f"no {n} consecutive free loopback ports found")


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """torchx's LocalScheduler replaces this process's SIGINT/SIGTERM handlers (Ctrl-C would
    no longer raise KeyboardInterrupt); put the previous ones back."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
