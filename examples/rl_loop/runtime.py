"""The services the loop runs on: the runtime started on the run's slots, and the trainer,
the generator and (with `grpo.beta > 0`) the reference spawned on them, each with its
restart policy; a checkpoint loaded into the trainer and its weights given to the generator
(and to a respawned generator replica before it serves); a batch spread over the
generator's replicas, seeded per request; a service woken ahead of its turn; and all of it
shut down. `loop.Loop` holds a `Runtime`; `model_dir` writes (or names) the initial policy
that every engine loads."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from colocate import init, phase
from colocate.engines.actors import ENGINE_MODULES, GeneratorActor, TrainerActor
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.resources import zygote
from colocate.resources.lost_hosts import LostHost
from colocate.resources.packing import ResourceRequest
from examples.rl_loop import task
from examples.rl_loop.budget import StepTraffic, arbiter_config
from examples.rl_loop.config import RLConfig
from examples.rl_loop.data import Row
from examples.rl_loop.host_memory import host_fields
from examples.rl_loop.recovery import Recovery
from examples.rl_loop.reference import spawn_reference
from examples.rl_loop.tools import ToolClient
from services import (
    Service,
    ServiceConfig,
    group_restarts,
    spawn_service,
    sync_weights,
)
from services.replica import Replica

ROOT = Path(__file__).resolve().parents[2]


def model_dir(cfg: RLConfig, out: Path, alphabet: str = task.ALPHABET) -> Path:
    """The initial policy's Hugging Face directory, which every engine loads: `model.path`,
    or a tiny random model over the task's characters (`alphabet`: the digit task's, or
    every character of the user's data) written under `out` (as base_model/: `out/model` is
    the trained one)."""
    m = cfg.model
    if m.path is not None:
        return Path(m.path)
    return write_tiny_model(out / "base_model", m.architecture, alphabet=alphabet,
                            hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                            kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                            max_positions=m.max_positions, init_std=m.init_std, seed=m.seed)


class Runtime:
    """The runtime and the run's services: the trainer, the generator and, with
    grpo.beta > 0, the reference, all loading `model_dir` (the initial policy); `start` has
    `recovery` (what the run does after a lost proc) follow the trainer's group."""

    def __init__(self, cfg: RLConfig, model_dir: Path, recovery: Recovery) -> None:
        self.cfg, self.model_dir, self.recovery = cfg, model_dir, recovery
        self.tools: ToolClient | None = None  # tools.funcs: the tools' own service
        self.turn_calls = 0  # generate_turns calls so far (a round robin's position)
        # transformers' per-load progress bars (here and in the procs) would bury the loop's
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        self.reference: Service | None = None
        self.training = asyncio.Lock()  # held from a train step through its weight sync
        self.resyncs = 0  # generator replicas given the weights after a respawn
        self.moves: StepTraffic | None = None  # what the switches moved, step by step
        self.down = False  # the runtime was shut down for new hosts that did not come
        self.threads_before: str | None = None  # OMP_NUM_THREADS before run.cpu_threads ("": unset)

    async def start(self, checkpoint: Path | None = None) -> None:
        """Start the runtime and both services; the trainer loads `checkpoint` when given;
        then the generator gets the trainer's weights."""
        run = self.cfg.run
        # the procs unpickle this example's loss function: they need the repo on their path
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        # vLLM logs each weight load at INFO, once a step, over the progress bar
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if run.cpu_threads:  # the procs' torch reads it as it starts (a proc's engines each
            # run on a thread of their own, each with a team of this many: see README)
            self.threads_before = os.environ.get("OMP_NUM_THREADS", "")
            os.environ["OMP_NUM_THREADS"] = str(run.cpu_threads)
        self.arbiter = dataclasses.replace(  # and the hosts' memory for backups
            arbiter_config(self.cfg, self.model_dir, torch.cuda.is_available()),
            **host_fields(run))
        zygote.preload(*ENGINE_MODULES[run.engine])  # procs forked with the engine imported
        await self._start_hosts()
        await self._spawn()
        await self.load(checkpoint)
        await self._count_moves()

    async def _start_hosts(self, leave_out: tuple[str, ...] = ()) -> None:
        """`run.hosts` hosts from `run.scheduler`, with `run.slots` slots each (twice as
        many apart); Slurm leaves out the nodes `leave_out` (those of lost hosts)."""
        run = self.cfg.run
        options = {"sbatch_args": (f"--exclude={','.join(leave_out)}",)} \
            if leave_out and run.scheduler == "slurm" else {}
        self.rm = await init(run.scheduler, hosts=run.hosts,
                             gpus_per_host=run.slots if run.colocate else 2 * run.slots,
                             arbiter=self.arbiter, timeout_s=run.host_timeout_s, **options)
        self.rm.lost_hosts.listeners.append(self.recovery.abandon)

    async def _spawn(self) -> None:
        """The trainer over every slot of every host, the generator (and the reference, and
        the tools' service)."""
        run, path = self.cfg.run, str(self.model_dir)
        groups = ("rl", "rl") if run.colocate else ("train", "generate")
        if not run.colocate:  # the generator's slots: as many as the trainer's, on each host
            await self.rm.reserve(ResourceRequest(groups[1], run.hosts, run.slots))
        # a lost trainer proc restarts the trainer's whole group, whose services come back
        # in the same processes as before, and the loop reloads its last checkpoint
        # (`recovery.Recovery`); a lost host brings the run back on new hosts
        # (`replace_hosts`); with run.max_restarts=0 the trainer does not come back: a
        # trainer back at step 0 would be a silent restart
        self.recovery.follow(group_restarts(groups[0]), self)
        restart = {"restart": "group"} if run.max_restarts else {"respawn": False}
        restart.update(call_bound(self.cfg))
        self.trainer = await spawn_service(
            ServiceConfig(hosts_per_replica=run.hosts, procs_per_host=run.slots,
                          resource_group=groups[0], **restart),
            TrainerActor, path, lr=self.cfg.grpo.lr,
            max_grad_norm=self.cfg.grpo.max_grad_norm, name="trainer",
            **vars(self.cfg.trainer))
        config, options = self._generator_service(groups[1], restart)
        self.generator = await spawn_service(config, GeneratorActor, path,
                                             name="generator", **options)
        self.generator.on_respawn.append(self._resync)
        if self.cfg.grpo.beta > 0:
            self.reference = await spawn_reference(self.cfg, path, groups[0], restart)
        if self.cfg.tools.used:  # CPU procs of their own: a dying tool costs a call
            self.tools = await ToolClient.spawn(self.cfg.tools, rm=self.rm)

    async def _count_moves(self) -> None:
        self.moves = StepTraffic(self.rm)  # what each step's switches move, from here on
        await self.moves.since_last(self.services())

    def lost_hosts(self) -> list[LostHost]:
        """The hosts this runtime lost, in the order they were seen."""
        return list(self.rm.lost_hosts.lost.values())

    async def replace_hosts(self) -> dict[str, float]:
        """After a lost host: stop what is left of the runtime (its job cancelled), then
        start it on `run.hosts` new hosts (Slurm: leaving out the lost host's node) with
        its services; the caller loads the checkpoint (`load`). Raises HostStartError when
        none come within `run.host_timeout_s`. Returns where the time went."""
        leave_out = tuple(self.rm.lost_hosts.nodes()[:1])
        began = time.monotonic()
        await self.rm.shutdown(grace_s=2.0)
        self.down = True  # until new hosts are up: nothing left to stop
        stopped = time.monotonic()
        await self._start_hosts(leave_out)
        self.down = False
        started = time.monotonic()
        await self._spawn()
        return {"stop_s": stopped - began, "hosts_s": started - stopped,
                "spawn_s": time.monotonic() - started}

    async def load(self, checkpoint: Path | None) -> None:
        """The trainer loads `checkpoint` (None: it keeps the weights it has), then the
        generator gets the trainer's weights (and ends awake)."""
        if checkpoint is not None:
            async with phase(self.trainer):
                await self.trainer.load_checkpoint.route(str(checkpoint / "trainer"))
        await sync_weights(self.trainer, self.generator)
        if self.moves is not None and self.moves.rm is not self.rm:  # on new hosts: from here
            await self._count_moves()

    def _generator_service(self, group: str, restart: dict[str, Any]
                           ) -> tuple[ServiceConfig, dict[str, Any]]:
        """The generator's service config and engine options. The torch engine: one
        replica per slot of every host. vLLM on several slots, `generator.replicas=spmd`:
        one replica over all of them, on every host (tp x dp ranks, called SPMD), the
        node-scale hybrid engine; `per_copy`: one replica of tp slots per model copy, each
        an engine of its own that a call reaches alone (as veRL's agent loop runs a vLLM
        server per copy), so an episode's turns find its prefix in its copy's cache
        (`generate_turns`) while the other copies generate. Beside the trainer it takes
        the trainer's restart policy (one per group); on slots of its own, a lost replica
        is respawned alone and given the weights (`_resync`)."""
        gen, run = self.cfg.generator, self.cfg.run
        # every wake comes with the trainer's weights (a sync): keep none across sleeps
        options = {"engine": run.engine, "max_batch": gen.max_batch, "keep_weights": False}
        if run.engine == "torch" and gen.session_cache_mb:
            options.update(session_cache_bytes=gen.session_cache_mb << 20)
        if run.engine == "vllm" and gen.block_size:
            options.update(block_size=gen.block_size)
        if self.cfg.served_positions:
            options.update(max_model_len=self.cfg.served_positions)
        shared = run.colocate and restart.get("restart") == "group"
        shape = {"resource_group": group, **call_bound(self.cfg), **(restart if shared else {})}
        if run.engine == "torch":
            config = ServiceConfig(num_replicas=run.slots * run.hosts, **shape)
        elif run.slots * run.hosts == 1:
            config = ServiceConfig(**shape)
        elif gen.replicas == "per_copy":  # an engine per model copy, on tp slots of a host
            tp = gen.tensor_parallel_size
            config = ServiceConfig(num_replicas=run.slots * run.hosts // tp, procs_per_host=tp,
                                   **shape)
            options.update(tensor_parallel_size=tp)
        else:
            tp = gen.tensor_parallel_size
            config = ServiceConfig(hosts_per_replica=run.hosts, procs_per_host=run.slots,
                                   **shape)
            options.update(tensor_parallel_size=tp,
                           data_parallel_size=run.slots * run.hosts // tp)
        return config, options

    async def _resync(self, replica: Replica) -> None:
        """A generator replica came back from a failure with the initial weights: give it
        the trainer's before it takes a call (never while a train step or a sync runs)."""
        async with self.training:
            await sync_weights(self.trainer, self.generator, [replica])
        self.resyncs += 1

    async def stop(self) -> None:
        """Shut the runtime down, every service with it."""
        if not self.down:
            await self.rm.shutdown()
        if self.threads_before is not None:  # later runs in this process start as before
            if self.threads_before:
                os.environ["OMP_NUM_THREADS"] = self.threads_before
            else:
                os.environ.pop("OMP_NUM_THREADS", None)

    def services(self) -> dict[str, Service]:
        """The run's services by tenant name."""
        named = {"trainer": self.trainer, "generator": self.generator}
        return named if self.reference is None else {**named, "reference": self.reference}

    async def generate(self, prompts: list[Row], params: SamplingParams, copies: int
                       ) -> tuple[list[list[int]], list]:
        """`copies` completions per prompt, spread over the generator's replicas."""
        tokens = [p.tokens for p in prompts for _ in range(copies)]
        return tokens, await self.generate_ids(tokens, params)

    async def generate_ids(self, tokens: list[list[int]], params: SamplingParams) -> list:
        """A completion of each prompt (token ids), spread over the generator's replicas."""
        chunks = max(1, len(self.generator.replicas))
        size = -(-len(tokens) // chunks)
        parts = await asyncio.gather(*(
            self.generator.generate.route(tokens[i:i + size], self._seeded(params, i))
            for i in range(0, len(tokens), size)))
        return [c for part in parts for c in part]

    async def generate_turns(self, tokens: list[list[int]], params: SamplingParams,
                             sessions: list[str], sticky: bool = True,
                             continuous: bool = False) -> list:
        """A completion of each prompt, the next turn of the episode `sessions[i]` names:
        with `sticky`, each episode's turns on one replica (its session's, which may keep
        its KV prefix between turns: `generator.session_cache_mb`), the rows of a replica in
        one call; else each call's rows dealt to the replicas in turn, one further on each
        call (round robin: a benchmark's comparison). Seeded per row position. With
        `continuous` the calls join their replica's running batch
        (`generate_continuous`) instead of being batches of their own."""
        replicas = max(1, len(self.generator.replicas))
        self.turn_calls += 1
        home = [zlib.crc32(session.encode()) % replicas if sticky
                else (i + self.turn_calls) % replicas for i, session in enumerate(sessions)]
        out: list = [None] * len(tokens)

        async def on(replica: int) -> None:
            rows = [i for i, h in enumerate(home) if h == replica]
            endpoint = self.generator.generate_continuous if continuous \
                else self.generator.generate
            async with self.generator.session(id=f"episodes-{replica}"):  # one replica's
                got = await endpoint.route(
                    [tokens[i] for i in rows], self._seeded(params, rows[0]), None,
                    [sessions[i] for i in rows])
            for i, completion in zip(rows, got, strict=True):
                out[i] = completion

        await asyncio.gather(*(on(r) for r in sorted(set(home))))
        return out

    @staticmethod
    def _seeded(params: SamplingParams, first: int) -> SamplingParams:
        """`params` for the prompts from index `first` on: request i of the whole batch is
        seeded with seed + i, whichever replica serves it, so a run repeats exactly."""
        return params if params.seed is None else dataclasses.replace(params,
                                                                       seed=params.seed + first)


def call_bound(cfg: RLConfig) -> dict[str, float]:
    """The services' bound on a call (`run.call_timeout_s`), where the run sets one."""
    return {"call_timeout_s": cfg.run.call_timeout_s} if cfg.run.call_timeout_s else {}


def switch_ahead(target: Service) -> asyncio.Future[float]:
    """Start waking `target`, a step's next phase, ahead of its turn (while the step does
    what needs neither); the future gives how long the switch took (the step waits only for
    what is left of it)."""
    async def wake() -> float:
        began = time.monotonic()
        async with phase(target):  # it stays awake after: the step's own phase is free
            pass
        return time.monotonic() - began

    return asyncio.ensure_future(wake())


def drop(ahead: asyncio.Future) -> None:
    """End a switch started ahead for a step that failed before it was needed (its error,
    if any, is the step's failure's consequence: retrieved here, not logged)."""
    ahead.cancel()
    ahead.add_done_callback(lambda done: done.cancelled() or done.exception())
