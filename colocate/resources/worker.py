"""Entry point of one Monarch host started through torchx (see `colocate.resources.torchx_hosts`).

    python -m colocate.resources.worker [--host H] [--port-base P] [--replica-id R]
                                        [--parent-pid PID]

It serves `tcp://H:(P + R)` with `monarch.actor.run_worker_loop_forever` until the client's
HostMesh shuts it down (or it is killed). H defaults to this machine's FQDN, as Monarch's own
`serve()` does; `--host 127.0.0.1 --replica-id ${replica_id}` gives each of several local
replicas its own loopback port. When the launcher sets MONARCH_SERVICE_PROC_IDS and
MONARCH_SERVICE_PROC_RANK, the address carries this host's service identity
(`<proc-id>@tcp://...`), the form Monarch's Slurm/Kubernetes/SPMD launchers use.
With `--parent-pid`, the worker exits when that process is gone (local runs: no orphans if
the client dies without stopping its hosts). With `--slurm` (one task per node of a Slurm
job, see `colocate.resources.slurm_hosts`), H is the node's Slurm name ($SLURMD_NODENAME)
and the service rank the node's index in the job ($SLURM_NODEID).

On a host without GPUs the worker starts a fork server (`colocate.resources.zygote`) and
names its socket in its environment (`proc_main.HOST_FORK_ENV`), which the procs Monarch
starts here inherit: those the client asks to be forked on their host (`proc_main.HOST`)
are, instead of each importing torch. It ends with the worker. COLOCATE_FORK_PROCS=0 in the
worker's environment turns it off.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

DEFAULT_PORT = 26600  # the port Monarch's serve() gives cluster workers


def worker_address(host: str, port: int) -> str:
    """The address a worker serves on, with its service identity when the launcher gave one."""
    from monarch.job import SERVICE_PROC_IDS_ENV, ranked_service_proc_id_from_env, service_proc_addr

    proc_id = ranked_service_proc_id_from_env() if SERVICE_PROC_IDS_ENV in os.environ else None
    return service_proc_addr(f"tcp://{host}:{port}", proc_id)


def _exit_with(parent_pid: int, poll_s: float = 0.5) -> None:
    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass  # alive, owned by someone else
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve_forks() -> None:
    """Start this host's fork server, unless the host has GPUs or forking is off."""
    from colocate.resources import zygote
    from colocate.resources.gpus import gpus_per_host
    from colocate.resources.proc_main import HOST_FORK_ENV

    if zygote.wanted() and not gpus_per_host():
        os.environ[HOST_FORK_ENV] = zygote.address()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address to serve on (default: FQDN)")
    parser.add_argument("--port-base", type=int, default=DEFAULT_PORT)
    parser.add_argument("--replica-id", type=int, default=0, help="added to --port-base")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when it is gone")
    parser.add_argument("--slurm", action="store_true",
                        help="host: $SLURMD_NODENAME, service rank: $SLURM_NODEID")
    args = parser.parse_args(argv)

    host = args.host
    if args.slurm:
        from monarch.job import SERVICE_PROC_RANK_ENV

        host = host or os.environ["SLURMD_NODENAME"]
        os.environ.setdefault(SERVICE_PROC_RANK_ENV, os.environ["SLURM_NODEID"])
    address = worker_address(host or socket.getfqdn(), args.port_base + args.replica_id)
    if args.parent_pid is not None:
        _exit_with(args.parent_pid)
    _serve_forks()
    print(f"colocate worker pid {os.getpid()} serving on {address}", flush=True)

    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(ca="trust_all_connections", address=address)


if __name__ == "__main__":
    main()
