"""The engines as colocated tenants: `TrainerActor`, `GeneratorActor` and `ReferenceActor`
on Monarch procs.

Both load the same local Hugging Face directory (`models.load_model`; vLLM loads it
itself), so they start with the same weights. Each hands its engine's tenancy to
`TenantActor` (`self.tenancy = engine.tenancy`), whose sleep, wake and describe endpoints
then act on the engine's stages. A trainer and a generator spawned in one
resource group share each proc; `ResourceManager.handoff(trainer, generator)` then passes
the trainer's weights to the generator in place (see `SlotArbiter.handoff`). Across procs
of one host the trainer's `export_weights` and the generator's `load_exported` go through
shared memory; across hosts, the trainer's `offer_weights` and the generator's `load_remote` go over
Monarch RDMA buffers.

Each step's torch work (`train_step`, the torch generator's `generate`, `forward`) runs on
the actor's `ComputeThread`, so its allocation churn keeps a malloc arena apart from
Monarch's own (see `compute_thread`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from monarch.actor import ActorError, Port, endpoint

from colocate.arbiter.actor import TenantActor
from colocate.calls import needs, preemptible
from colocate.engines import generator, trainer
from colocate.engines.compute_thread import ComputeThread
from colocate.engines.export import write_hf_model
from colocate.engines.generating import Generator
from colocate.engines.models import load_model
from colocate.engines.reference import ForwardFn, ReferencePolicy
from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from colocate.engines.weights import (
    RemoteWeights,
    WeightManifest,
    WeightStream,
    digest,
    export_weights,
    fetch_weights,
    offer_weights,
    published,
    read_exported,
)

ENGINES = ("torch", "vllm")
# what a proc imports to start each engine, beyond torch, for the procs' fork server to
# import once (`colocate.resources.zygote.preload`; bench/RESULTS.md, "A proc's start")
ENGINE_MODULES = {"torch": (), "vllm": ("colocate.engines.vllm_generator",
                                        "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker")}


class TrainerActor(TenantActor):
    """A `PolicyTrainer` on each proc of a replica; `train_step(loss_fn, batch)` runs one
    AdamW step. `options` go to `PolicyTrainer` (parallel="ddp"|"fsdp", mixed_precision,
    activation_checkpointing, bucket_mb...)."""

    def __init__(self, model_dir: str, lr: float = 1e-3, **options: Any) -> None:
        self.model_dir = model_dir
        self.trainer = trainer.PolicyTrainer(load_model(model_dir), lr=lr,
                                             prefix=self.tenant_name, **options)
        self.tenancy = self.trainer.tenancy
        self.compute = ComputeThread(f"{self.tenant_name}-compute")
        self.exports = 0
        self.offered: list = []  # the tensors under the last RDMA offer, kept alive

    @endpoint
    def train_step(self, loss_fn: trainer.LossFn, batch: Any) -> dict[str, float]:
        return self.compute.run(self.trainer.step, loss_fn, batch)

    @endpoint
    @needs("weights")
    def weights_need_every_rank(self) -> bool:
        """Whether its full weights are made by all its ranks together (FSDP: each bucket
        is gathered from every rank's shard), so a sync must call every rank at once; a
        DDP rank holds the whole model. Answered asleep too."""
        return self.trainer.sharded

    @endpoint
    @needs("weights")
    def export_weights(self) -> WeightManifest | None:
        """The weights, in this host's shared memory, for a generator on other procs.
        Call it on every rank: rank 0 writes and answers, the others answer None (an FSDP
        rank takes part in each bucket's all-gather first)."""
        self.exports += 1
        weights = self._full_weights()
        if weights is None:
            return None
        return export_weights(weights, self.tenant_name, self.exports)

    @endpoint
    @needs("weights")
    def offer_weights(self) -> RemoteWeights | None:
        """The weights as RDMA buffers, for generators on other hosts (valid until the
        next offer). Call it on every rank, as `export_weights`."""
        self.exports += 1
        weights = self._full_weights()
        if weights is None:
            return None
        self.offered = list(weights.tensors())
        return offer_weights(self.offered, self.exports)

    def _full_weights(self) -> WeightStream | None:
        """Rank 0: the full weights, bucket after bucket; other ranks: None, once they took
        part in the gathers a sharded trainer needs."""
        weights = self.trainer.weights()
        if self.trainer.rank == 0:
            return weights
        if self.trainer.sharded:
            for _ in weights.buckets():
                pass
        return None

    @endpoint
    @needs("weights")
    def checksum(self) -> str:
        return digest(self.trainer.weights().tensors())

    @endpoint
    @needs("weights", "optimizer")
    def save_checkpoint(self, path: str, wait: bool = True) -> None:
        """Save the training state into directory `path`, with the model directory's
        config and tokenizer under `path/hf` (`PolicyTrainer.save_checkpoint`). Call it on
        every rank (a service's `route` does); `wait=False` returns once staged."""
        self.trainer.save_checkpoint(path, wait=wait, frame_dir=self.model_dir)

    @endpoint
    @needs("weights")
    def wait_checkpoint(self) -> str | None:
        """The save in flight's final path once written (None when none was in flight);
        raises the `CheckpointError` of a failed write. Every rank."""
        return self.trainer.wait_checkpoint()

    @endpoint
    def poll_checkpoint(self) -> str | None:
        """`PolicyTrainer.poll_checkpoint`: "writing", "written" (ended: `wait_checkpoint`
        says how) or None. Rank 0's answer is the service's."""
        return self.trainer.poll_checkpoint()

    @endpoint
    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint saved by any world size (`PolicyTrainer.load_checkpoint`).
        Every rank."""
        self.trainer.load_checkpoint(path)

    @endpoint
    @needs("weights")
    def export_model(self, out_dir: str) -> str | None:
        """The trained model as a Hugging Face directory at `out_dir`
        (`export.write_hf_model`). Call it on every rank: rank 0 writes and answers the
        path, the others answer None (an FSDP rank takes part in each bucket's gather)."""
        weights = self._full_weights()
        if weights is None:
            return None
        return str(write_hf_model(weights, self.model_dir, out_dir))


class GeneratorActor(TenantActor):
    """A generator engine ("torch": `TorchGenerator`; "vllm": `VLLMGenerator`) on one proc."""

    def __init__(self, model_dir: str, engine: str = "torch", max_batch: int = 64,
                 **options: Any) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r}: use one of {ENGINES}")
        self.engine: Generator
        if engine == "torch":
            self.engine = generator.TorchGenerator(load_model(model_dir), max_batch,
                                                   prefix=self.tenant_name, **options)
            self.compute: ComputeThread | None = ComputeThread(f"{self.tenant_name}-compute")
        else:
            from colocate.engines.vllm_generator import VLLMGenerator

            self.engine = VLLMGenerator(model_dir, max_batch=max_batch,
                                        prefix=self.tenant_name, **options)
            self.compute = None  # vLLM runs on the thread it was made on, with its own memory
        self.tenancy = self.engine.tenancy

    @endpoint
    @needs("weights", "kv_cache")
    @preemptible
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 partial: list[Completion | None] | None = None,
                 sessions: list[str | None] | None = None) -> list[Completion]:
        """One completion per prompt. A switch with preemption (`phase(trainer,
        preempt=True)`) makes the torch engine return at its next decoding step, with
        each completion not ended by then `finished=False`; pass those back as `partial`
        (one per prompt, None for none) to continue them on the weights loaded since (see
        `TorchGenerator.generate`). The vLLM engine does the same (a one-rank engine: it
        aborts its requests and returns their outputs so far; a replica of several ranks
        drains).

        `sessions` names per prompt the trajectory it continues (None: none; route the
        call inside the trajectory's `svc.session(id=...)`, so its turns reach this
        replica): the engine reuses what it kept of the trajectory's keys and values, and
        each completion's `prefix` counts the tokens reused and recomputed."""
        if self.compute is None:
            return self.engine.generate(prompts, params, partial, self.preemption.asked,
                                        sessions)
        return self.compute.run(self.engine.generate, prompts, params, partial,
                                self.preemption.asked, sessions)

    @endpoint(explicit_response_port=True)
    @needs("weights", "kv_cache")
    @preemptible
    def generate_continuous(self, port: Port, prompts: list[list[int]],
                            params: SamplingParams,
                            partial: list[Completion | None] | None = None,
                            sessions: list[str | None] | None = None) -> None:
        """`generate` by continuous batching: the endpoint takes the call and returns, and
        the answer comes once the call's rows have ended; calls taken meanwhile join the
        same running batch (`TorchGenerator.submit`; `VLLMGenerator.submit`, a one-rank
        engine), so many small calls (an episode's turn each) decode together. With the
        torch engine a row's tokens depend on the row alone (its prompt, the seed + its
        index), however the calls overlap; with vLLM, as far as its kernels are
        batch-invariant. Preempted like `generate` (its rows come back unfinished); a
        sleep waits for its rows.

        Monarch runs an actor's sync endpoints one at a time, so the answer goes through
        the call's port (`explicit_response_port`), sent from the decode thread."""
        ended = self.preemption.begin()  # counted until answered: a preempt waits for it

        def failed(err: BaseException) -> None:  # wrapped as Monarch wraps an endpoint's
            ended()
            port.exception(ActorError(err, "Actor call generate_continuous failed."))

        def answer(done: Future[list[Completion]]) -> None:
            err = done.exception()
            if err is not None:
                failed(err)
            else:
                ended()
                port.send(done.result())

        try:
            self.engine.submit(prompts, params, partial, self.preemption.asked, sessions
                               ).add_done_callback(answer)
        except Exception as err:  # through the port: one escaping would fail the actor
            failed(err)

    @endpoint
    @needs("weights")
    def end_session(self, session: str) -> None:
        """Forget trajectory `session` on this replica: its cached keys and values go (the
        torch engine's; vLLM's prefix cache lets blocks go by itself)."""
        self.engine.end_session(session)

    @endpoint
    @needs("weights")
    def prefix_counts(self, reset: bool = False) -> PrefixCounts:
        """The prefix counts of every row this replica generated since it started (or
        the last `reset=True`): `recompute_share` is the share of the tokens a session
        had computed before that were computed again."""
        return self.engine.prefix_counts(reset)

    def preempt(self) -> bool:
        """The preempt hook (see `TenantActor.preempt`): the torch engine polls the flag
        before each decoding step, vLLM's after each engine step (then aborts its
        requests); a vLLM replica of several ranks cannot stop early (its calls drain)."""
        if not self.engine.preemptible:
            return False
        self.preemption.request()
        return True

    @endpoint
    @needs("weights")
    def receive(self, source: str) -> int:
        return self.engine.load_weights(published(source))

    @endpoint
    @needs("weights")
    def load_exported(self, manifest: WeightManifest) -> int:
        return read_exported(manifest, self.engine.load_weights)

    @endpoint
    @needs("weights")
    def load_remote(self, remote: RemoteWeights) -> int:
        """Fetch offered weights from another host, then load them (nothing is written
        unless every tensor arrived and matches)."""
        return self.engine.load_weights(fetch_weights(remote))

    @endpoint
    @needs("weights")
    def checksum(self) -> str:
        return digest(self.engine.weights().tensors())


class ReferenceActor(TenantActor):
    """A frozen `ReferencePolicy` (the starting weights) on each proc of a replica, laid out
    like the trainer beside it (`parallel`, `mixed_precision`); `forward(fn, batch)` runs
    `fn(model, batch)` without gradients. Call it on every rank together (a service's
    `route` does): under FSDP each forward gathers the layers from every rank."""

    def __init__(self, model_dir: str, parallel: str = "ddp",
                 mixed_precision: bool = False) -> None:
        self.reference = ReferencePolicy(load_model(model_dir), prefix=self.tenant_name,
                                         parallel=parallel, mixed_precision=mixed_precision)
        self.tenancy = self.reference.tenancy
        self.compute = ComputeThread(f"{self.tenant_name}-compute")

    @endpoint
    @needs("weights")
    def forward(self, fn: ForwardFn, batch: Any) -> Any:
        return self.compute.run(self.reference.forward, fn, batch)

    @endpoint
    @needs("weights")
    def checksum(self) -> str:
        return self.reference.checksum()
