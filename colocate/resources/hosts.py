"""Hosts: turn a scheduler choice into a Monarch HostMesh of N hosts, and stop it.

    job = start_hosts("torchx:local_cwd", hosts=2)
    procs = job.mesh.spawn_procs(per_host={"gpus": 2})
    ...
    job.stop()                      # or: with start_hosts(...) as job: ...

Schedulers and how each starts:

- ``"local"``: this process's own host, ``monarch.actor.this_host()``; one host only.
  Nothing is started, so ``stop()`` leaves it alone.
- ``"processes"``: N local hosts through ``monarch.job.ProcessJob({"hosts": N})``: each is a
  subprocess running ``run_worker_loop_forever`` on a unix socket (``ipc://``).
  ``stop()`` shuts the mesh down, then ``job.kill()`` (SIGTERM, then SIGKILL).
- ``"torchx:<scheduler>"``: a torchx AppDef with one role ``hosts`` of N replicas, each running
  ``python -m colocate.resources.worker`` (see ``worker.py``), submitted with
  ``torchx.runner.get_runner().run(app, scheduler, cfg)``; the client then calls
  ``attach_to_workers(ca="trust_all_connections", workers=[...])``.

  * ``local_cwd``: replica i serves ``tcp://127.0.0.1:(P + i)``, P a base
    port found free by binding, passed as ``--host 127.0.0.1 --port-base P --replica-id
    ${replica_id}``; the workers also exit when this process dies (``--parent-pid``). Their
    logs go to a temporary ``log_dir`` removed by ``stop()`` (kept if they fail to start, or
    when ``log_dir=`` is given).
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
  ``dryrun_torchx()`` shows the request (sbatch script, Volcano job) without submitting.
- a Monarch job object (``SlurmJob``, ``KubernetesJob``, ``ProcessJob``, any ``JobTrait``):
  ``job.state(cached_path=None)`` and its host mesh named ``mesh_name=`` (needed when the job
  has several); ``stop()`` shuts the mesh down, then ``job.kill()``.

GPU slots: slot i of a host is the i-th GPU that the host's procs may use (``visible_gpus``:
the host's inherited ``CUDA_VISIBLE_DEVICES``, indices read in its ``CUDA_DEVICE_ORDER``, or
every GPU in PCI bus order). A slot's proc gets ``CUDA_VISIBLE_DEVICES=<that GPU's UUID>``,
resolved on its own host when it starts (``run_on_slot_gpu``), so neither NVML's nor CUDA's
numbering, nor another host's GPUs, can put it on the wrong GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import runpy
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: a GPU slot's proc imports this module at bootstrap
    from monarch.actor import HostMesh

logger = logging.getLogger(__name__)

WORKER_MODULE = "colocate.resources.worker"
ROLE_NAME = "hosts"
CLUSTER_PORT = 26600  # as Monarch's serve()
ACCEPTED = ('"local"', '"processes"', '"torchx:<scheduler>"', "a Monarch job (JobTrait)")


class HostStartError(RuntimeError):
    """The hosts did not come up (in time); the message says where their logs are."""

    def __init__(self, message: str, *, handle: str | None = None, logs: str | None = None):
        super().__init__(message)
        self.handle = handle  # the torchx app handle, if any
        self.logs = logs  # where the workers' logs are (kept after a failed start)


@dataclass
class HostJob:
    """N Monarch hosts (``mesh``) started by ``start_hosts``; ``stop()`` ends them."""

    mesh: HostMesh
    scheduler: str
    num_hosts: int
    handle: str | None = None  # the torchx app handle, for torchx schedulers
    logs: str | None = None  # where the workers' logs are, when known
    _kill: Callable[[], None] | None = field(default=None, repr=False)
    _owns_hosts: bool = field(default=True, repr=False)
    _stopped: bool = field(default=False, repr=False)

    def stop(self, grace_s: float = 5.0) -> None:
        """Shut the hosts down (gracefully, for up to `grace_s`), then kill what is left.
        Idempotent; a no-op for the "local" host, which this job did not start."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._owns_hosts:
                try:
                    self.mesh.shutdown().get(timeout=grace_s)
                except Exception as e:  # dead or unreachable hosts: the kill below ends them
                    logger.info("graceful shutdown of %s hosts failed: %r", self.scheduler, e)
        finally:
            if self._kill is not None:
                self._kill()

    def __enter__(self) -> HostJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_hosts(
    scheduler: str | object = "local",
    hosts: int | None = None,
    *,
    timeout_s: float = 60.0,
    **options: Any,
) -> HostJob:
    """Start `hosts` Monarch hosts (default 1) with `scheduler` (see the module docstring) and
    return them as a HostJob once they answer, or raise HostStartError after `timeout_s`."""
    if _is_monarch_job(scheduler):
        return _from_monarch_job(scheduler, hosts, timeout_s, **options)
    if not isinstance(scheduler, str):
        raise ValueError(f"unknown scheduler {scheduler!r}; accepted: {', '.join(ACCEPTED)}")
    n = 1 if hosts is None else hosts
    if n < 1:
        raise ValueError(f"hosts must be >= 1, got {n}")
    if scheduler == "local":
        _no_options(scheduler, options)
        if n != 1:
            raise ValueError(
                f'scheduler "local" is this one host; for {n} local hosts use "processes"'
            )
        from monarch.actor import this_host

        return HostJob(this_host(), "local", 1, _owns_hosts=False)
    if scheduler == "processes":
        return _start_processes(n, timeout_s, **options)
    if scheduler.startswith("torchx:") and scheduler != "torchx:":
        return _start_torchx(scheduler.removeprefix("torchx:"), n, timeout_s, **options)
    raise ValueError(f"unknown scheduler {scheduler!r}; accepted: {', '.join(ACCEPTED)}")


def dryrun_torchx(scheduler: str, hosts: int, **options: Any) -> Any:
    """torchx's AppDryRunInfo for `hosts` hosts on `scheduler` ("slurm", "kubernetes", or
    "torchx:slurm"...), built as ``start_hosts`` builds it; nothing is submitted.
    ``str()`` of it is the request (e.g. the sbatch script, the Volcano job)."""
    from torchx.runner import get_runner

    name = scheduler.removeprefix("torchx:")
    app, cfg, _ = _torchx_app(name, hosts, port=options.pop("port", None), **options)
    with _keep_signal_handlers(), get_runner() as runner:
        return runner.dryrun(app, name, cfg=cfg)


GPU_SLOT_ENV = "COLOCATE_GPU_SLOT"  # set at bootstrap: resolve this slot's GPU, then start


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML lists it (NVML's order is the PCI bus order)."""

    uuid: str  # "GPU-..."
    name: str  # the model, e.g. "NVIDIA H100 80GB HBM3"


def nvml_gpus() -> list[Gpu]:
    """This host's GPUs in NVML (PCI bus) order, whatever CUDA_VISIBLE_DEVICES says; empty
    where NVML is unavailable (no driver, no GPU, no pynvml)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        found = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle)
            found.append(Gpu(uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                             name.decode() if isinstance(name, bytes) else str(name)))
        return found
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def visible_gpus(env: Mapping[str, str], gpus: list[Gpu]) -> list[str]:
    """The UUIDs of the GPUs that a process started with `env` may use, in its CUDA order;
    `gpus` is the host's GPUs in NVML (PCI bus) order.

    Without CUDA_VISIBLE_DEVICES: every GPU, in PCI bus order. With it: its entries, UUIDs
    (or unique UUID prefixes) or indices, read as CUDA reads them (up to the first invalid
    one). Indices count in CUDA_DEVICE_ORDER: PCI_BUS_ID is NVML's order; the default,
    FASTEST_FIRST, puts the fastest GPU first and leaves the rest unspecified, taken here as
    PCI bus order only when every GPU is the same model (else refused: the index could name
    another GPU)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [g.uuid for g in gpus]
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    found: list[str] = []
    for entry in (e.strip() for e in listed.split(",")):
        if entry.startswith(("GPU-", "MIG-")):
            matches = [g.uuid for g in gpus if g.uuid.startswith(entry)]
            if len(matches) != 1:
                break
            found.append(matches[0])
            continue
        if not entry.isdigit() or int(entry) >= len(gpus):
            break
        if order != "PCI_BUS_ID" and len({g.name for g in gpus}) > 1:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={listed!r} lists indices, which in CUDA_DEVICE_ORDER="
                f"{order} order this host's different GPU models "
                f"({sorted({g.name for g in gpus})}) in an order NVML cannot tell. Set "
                "CUDA_DEVICE_ORDER=PCI_BUS_ID, or list GPU UUIDs (`nvidia-smi -L`)."
            )
        found.append(gpus[int(entry)].uuid)
    return list(dict.fromkeys(found))


def slot_gpu(slot: int, env: Mapping[str, str], gpus: list[Gpu]) -> str:
    """The UUID of GPU slot `slot` of a host whose procs start with `env`: the slot-th of
    `visible_gpus(env, gpus)`."""
    visible = visible_gpus(env, gpus)
    if not 0 <= slot < len(visible):
        inherited = env.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"GPU slot {slot} does not exist on this host: its procs may use {len(visible)} "
            f"GPU(s) ({len(gpus)} found by NVML"
            + (f", CUDA_VISIBLE_DEVICES={inherited!r}" if inherited is not None else "")
            + "). Give init() a gpus_per_host that every host has."
        )
    return visible[slot]


def run_on_slot_gpu(module: str) -> None:
    """A GPU slot's proc bootstrap (see `colocate.resources.procs._bootstrap`): set
    CUDA_VISIBLE_DEVICES to the UUID of slot $COLOCATE_GPU_SLOT's GPU, resolved here on the
    proc's own host (its GPUs, its inherited CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER)
    before anything starts CUDA, then run `module` as `python -m` would."""
    slot = int(os.environ.pop(GPU_SLOT_ENV))
    os.environ["CUDA_VISIBLE_DEVICES"] = slot_gpu(slot, os.environ, nvml_gpus())
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def gpus_per_host() -> int:
    """GPUs on this host that its processes may use: NVML's count, narrowed by an inherited
    CUDA_VISIBLE_DEVICES (`visible_gpus`); 0 where NVML is unavailable (no driver, no GPU,
    no pynvml)."""
    return len(visible_gpus(os.environ, nvml_gpus()))


# --- processes ---------------------------------------------------------------------------


def _start_processes(n: int, timeout_s: float, env: dict[str, str] | None = None,
                     **options: Any) -> HostJob:
    from monarch.job import ProcessJob

    _no_options("processes", options)
    job = ProcessJob({"hosts": n}, env=env)
    try:
        mesh = job.state(cached_path=None).hosts
        logs = "the Monarch log, /tmp/$USER/monarch_log.log (ProcessJob drops worker output)"
        _wait_initialized(mesh, timeout_s, "processes", logs)
    except BaseException:
        job.kill()
        raise
    return HostJob(mesh, "processes", n, _kill=job.kill)


# --- Monarch job objects ------------------------------------------------------------------


def _is_monarch_job(obj: object) -> bool:
    from monarch.job import JobTrait

    if isinstance(obj, JobTrait):
        return True
    return callable(getattr(obj, "state", None)) and callable(getattr(obj, "kill", None))


def _from_monarch_job(job: Any, hosts: int | None, timeout_s: float,
                      mesh_name: str | None = None, cached_path: str | None = None,
                      **options: Any) -> HostJob:
    label = type(job).__name__
    _no_options(label, options)
    was_active = bool(getattr(job, "active", False))
    try:
        state = job.state(cached_path=cached_path)
        names = sorted(getattr(state, "_hosts", {}))  # JobState keeps its meshes by name there
        if mesh_name is None:
            if len(names) != 1:
                raise ValueError(f"{label} has meshes {names}: pass mesh_name= to pick one")
            mesh_name = names[0]
        try:
            mesh = getattr(state, mesh_name)
        except AttributeError:
            raise ValueError(f"{label} has no mesh {mesh_name!r}; it has {names}") from None
        n = len(mesh)
        if hosts is not None and hosts != n:
            raise ValueError(f"{label} mesh {mesh_name!r} has {n} hosts, not {hosts}")
        _wait_initialized(mesh, timeout_s, label, "the job's own logs")
    except BaseException:
        if not was_active:  # we applied it: don't leave it running
            job.kill()
        raise
    return HostJob(mesh, label, n, _kill=job.kill)


# --- torchx --------------------------------------------------------------------------------


def _start_torchx(name: str, n: int, timeout_s: float, port: int | None = None,
                  **options: Any) -> HostJob:
    from torchx.runner import get_runner
    from torchx.specs import AppState, AppStatus, parse_app_handle

    local = name == "local_cwd"
    own_logs = local and "log_dir" not in options
    if local:
        port = port if port is not None else _free_port_base(n)
        if own_logs:
            import tempfile

            options["log_dir"] = tempfile.mkdtemp(prefix="colocate_hosts_")
    app, cfg, proc_ids = _torchx_app(name, n, port=port, **options)
    port = port if port is not None else CLUSTER_PORT
    deadline = time.monotonic() + timeout_s
    runner = get_runner()
    try:
        with _keep_signal_handlers():  # torchx's local scheduler installs its own
            handle = runner.run(app, name, cfg=cfg)
    except BaseException:
        runner.close()
        if own_logs:
            shutil.rmtree(str(cfg["log_dir"]), ignore_errors=True)
        raise
    _, session, app_id = parse_app_handle(handle)
    if local:
        logs = os.path.join(str(cfg["log_dir"]), session, app_id, ROLE_NAME)
    else:
        logs = f"`torchx log {handle}`"
    scheduler = f"torchx:{name}"

    def kill(remove_logs: bool = False) -> None:
        try:
            runner.cancel(handle)
            end = time.monotonic() + 30
            while time.monotonic() < end:
                status = runner.status(handle)
                if status is None or status.is_terminal():
                    break
                time.sleep(0.2)
        finally:
            runner.close()
            if remove_logs:
                shutil.rmtree(str(cfg["log_dir"]), ignore_errors=True)

    def fail(why: str) -> HostStartError:
        msg = f"{scheduler}: {why} (app {handle}; worker logs: {logs})"
        return HostStartError(msg, handle=handle, logs=logs)

    def check_running(why: str = "the app ended before its hosts came up") -> AppStatus:
        status = runner.status(handle)
        if status is None or status.is_terminal():
            raise fail(f"{why}: {status and status.state}")
        return status

    try:
        hostnames = ["127.0.0.1"] * n
        while not local:  # cluster: the replicas' host names come from torchx, as in serve()
            status = check_running()
            replicas = sorted(status.roles[0].replicas, key=lambda r: r.id) if status.roles else []
            if status.state == AppState.RUNNING and len(replicas) == n and all(
                r.state == AppState.RUNNING for r in replicas
            ):
                hostnames = [r.hostname for r in replicas]
                if not all(hostnames):
                    raise fail(
                        "torchx reports no host names for the running replicas (torchx 0.7.0 "
                        "does not for slurm/kubernetes; torchx-nightly does); pass a Monarch "
                        "SlurmJob/KubernetesJob instead"
                    )
                break
            if time.monotonic() > deadline:
                raise fail(f"not running after {timeout_s:.0f} s ({status.state})")
            time.sleep(1.0)
        ports = [port + i for i in range(n)] if local else [port] * n
        while not all(_listening(h, p) for h, p in zip(hostnames, ports, strict=True)):
            check_running("the app ended before its hosts listened")
            if time.monotonic() > deadline:
                raise fail(f"hosts not listening after {timeout_s:.0f} s")
            time.sleep(0.1)
        mesh = _attach(name, hostnames, ports, proc_ids)
        remaining = max(deadline - time.monotonic(), 1.0)
        _wait_initialized(mesh, remaining, scheduler, logs, handle, check_running)
    except BaseException:
        kill()
        raise
    logger.info("%s: %d hosts up (app %s)", scheduler, n, handle)
    return HostJob(mesh, scheduler, n, handle=handle, logs=logs,
                   _kill=lambda: kill(remove_logs=own_logs))


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


# --- helpers -------------------------------------------------------------------------------


def _no_options(scheduler: str, options: dict[str, Any]) -> None:
    if options:
        raise ValueError(f"scheduler {scheduler} takes no options, got {sorted(options)}")


def _wait_initialized(mesh: HostMesh, timeout_s: float, scheduler: str, logs: str,
                      handle: str | None = None, check: Callable[[], None] | None = None) -> None:
    """Wait for the mesh to connect to all its hosts; `check()` (raising) every half second."""
    initialized = mesh.initialized  # a timed-out get() leaves it pending, to get() again
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            initialized.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))
            return
        except TimeoutError as e:
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                app = f"app {handle}; " if handle else ""
                raise HostStartError(
                    f"{scheduler}: hosts did not answer within {timeout_s:.0f} s "
                    f"({app}worker logs: {logs})", handle=handle, logs=logs
                ) from e
        except HostStartError:
            raise
        except Exception as e:
            raise HostStartError(
                f"{scheduler}: hosts failed ({logs}): {e!r}", handle=handle, logs=logs
            ) from e


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
