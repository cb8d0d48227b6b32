"""Trainer checkpoints: save, wait for and load a `PolicyTrainer`'s whole training state
through `torch.distributed.checkpoint` (DCP), atomically, in the background.

What is saved: parameters and AdamW state (`get_state_dict` / `set_state_dict`, so the
same code serves no-parallel, DDP and FSDP2 trainers, each rank writing its own part), the
step count, and each rank's RNG states (torch CPU, and CUDA's on CUDA). DCP reshards on
load: a checkpoint written by 2 FSDP ranks loads into 1 proc, into DDP, and back.

The directory (DCP's files, `trainer.json`, the model's frame under `hf/`, so a checkpoint
alone is enough to export a model) and the errors are `checkpoint_files`'. Durability:

- Asynchronous: `save(..., wait=False)` returns once the state is staged, a real copy in
  host memory (DCP's `BlockingAsyncStager`), then DCP writes it from a background thread;
  the staged copy goes once the write is done. At most one save is in flight (`poll` says
  whether it ended): a new save or load first finishes it (raising its error, if any).
- Atomic: every rank writes into one sibling temporary directory
  (`<parent>/.tmp-<name>-<unique>`); once DCP has every rank's part and `.metadata`,
  rank 0 renames it to `path` (an existing `path` is swapped out, then removed). A failed
  save (a full disk...) removes the temporary directory and leaves `path` as it was.
- Its own collectives: on several ranks the checkpoint's collectives run on a gloo group
  made for them once (`dist.new_group(backend="gloo")`), so a background write never
  interleaves with the training collectives on the default group.

The trainer must be awake (its "weights" and "optimizer" stages) to save or load: a
sleeping trainer's tensors are paused memory, so both refuse with `TagPausedError`, whose
message says how to wake it (waking costs the generator its memory: the caller decides).

Loading reads into a fresh state dict first and sets the trainer's tensors only once every
byte was read: a truncated or corrupt checkpoint raises `CorruptCheckpointError` and leaves
the trainer as it was. Errors are `CheckpointError`s that name the cause and what to do.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import uuid
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from colocate import memory
from colocate.engines.checkpoint_files import (
    FORMAT,
    FRAME,
    INFO,
    METADATA,
    READ_ERRORS,
    CheckpointWriteError,
    CorruptCheckpointError,
    check_same_model,
    one_line,
    read_info,
    swap_into_place,
    write_frame,
)

WRITING, WRITTEN = "writing", "written"  # what `poll` says of a save in flight

if TYPE_CHECKING:
    from colocate.arbiter.tenant import TaggedTenant

# a one-proc trainer saves and loads with no_dist=True on purpose; DCP still warns that it
# is "assuming the intent is to save in a single process", from its own thread (where a
# catch_warnings block in the caller would not reach): silence that one message
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized, assuming the intent is to", category=UserWarning)


class Trainer(Protocol):
    """What a checkpoint saves and loads of a trainer (a `PolicyTrainer`)."""

    steps: int

    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def parallel(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def tenancy(self) -> TaggedTenant: ...


class _CopyStager(BlockingAsyncStager):
    """DCP's blocking stager (new CPU tensors, then a copy: on CPU too, where `.to("cpu")`
    would return the live tensors), keeping weak references to what it staged: `release`
    frees that memory once the write is done, even while DCP's worker thread still holds
    the staged dict (it lets go of its work item only after the future completes)."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=False)
        self.staged: list[weakref.ref] = []
        self.staged_bytes = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        staged = super().stage(state_dict)
        for tensor in _tensors(staged):
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            self.staged.append(weakref.ref(local))
            self.staged_bytes += local.numel() * local.element_size()
        return staged

    def release(self) -> int:
        """Free the staged tensors' memory (call once the write is over); returns the
        bytes freed."""
        freed = 0
        for ref in self.staged:
            tensor = ref()
            if tensor is not None and tensor.untyped_storage().nbytes():
                freed += tensor.untyped_storage().nbytes()
                tensor.untyped_storage().resize_(0)
        return freed

    def staged_resident(self) -> int:
        """Bytes of staged tensors still held."""
        return sum(t.untyped_storage().nbytes() for t in (ref() for ref in self.staged)
                   if t is not None)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in _tensors(value)]
    if isinstance(tree, list | tuple):
        return [t for value in tree for t in _tensors(value)]
    return []


def _empty_like(tree: Any) -> Any:
    """The same structure with new, uninitialised tensors (DTensors keep their sharding)."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {key: _empty_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_empty_like(value) for value in tree]
    return tree


def _full_shapes(trainer: Trainer) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> full shape (a DTensor's shape is already the full one)."""
    return {name: tuple(t.shape) for name, t in trainer.model.state_dict().items()}


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """One trainer's checkpoints: the save in flight, and the gloo group its collectives
    run on (made once, on several ranks)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._lock = threading.Lock()
        self.last_stager: _CopyStager | None = None

    # -- the pieces every save and load share --------------------------------------------

    def group(self, trainer: Trainer) -> dist.ProcessGroup | None:
        """The checkpoint's own gloo group on several ranks; None on one proc. Every rank
        makes it at its first save or load (all ranks save and load together)."""
        if trainer.parallel == "none":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    @staticmethod
    def _ensure_awake(trainer: Trainer, action: str) -> None:
        try:
            trainer.tenancy.ensure_stage("weights")
            trainer.tenancy.ensure_stage("optimizer")
        except memory.TagPausedError as err:
            raise memory.TagPausedError(f"cannot {action} a checkpoint: {err}") from None

    def _broadcast(self, group: dist.ProcessGroup | None, value: Any) -> Any:
        """Rank 0's `value` on every rank (over the checkpoint's group)."""
        if group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    # -- save ----------------------------------------------------------------------------

    def save(self, trainer: Trainer, path: str | os.PathLike, wait: bool = True,
             frame_dir: str | os.PathLike | None = None) -> None:
        """See `PolicyTrainer.save_checkpoint`."""
        self.wait()
        self._ensure_awake(trainer, "save")
        path = Path(path).absolute()
        group = self.group(trainer)
        rank, world = trainer.rank, (dist.get_world_size() if group is not None else 1)
        has_optim = bool(trainer.optimizer.state)
        prepared: str | None = None
        if rank == 0:  # the temporary directory, its frame and trainer.json, by rank 0
            tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:12]}"
            try:
                tmp.mkdir(parents=True)
                write_frame(frame_dir, trainer.model.config, tmp / FRAME)
                (tmp / INFO).write_text(json.dumps({
                    "format": FORMAT, "world_size": world, "parallel": trainer.parallel,
                    "steps": trainer.steps, "optimizer": has_optim,
                    "params": {n: list(s) for n, s in _full_shapes(trainer).items()}},
                    indent=1))
                prepared = str(tmp)
            except OSError as err:
                shutil.rmtree(tmp, ignore_errors=True)
                prepared = f"error: {err!r}"
        prepared = self._broadcast(group, prepared)
        if prepared is None or prepared.startswith("error: "):
            raise CheckpointWriteError(f"cannot save checkpoint {path}: rank 0 could not "
                                       f"prepare its directory ({prepared}); nothing was "
                                       "written; free space or fix permissions, then retry")
        tmp = Path(prepared)
        state: dict[str, Any] = {"trainer": {"steps": torch.tensor(trainer.steps)},
                                 "rng": {str(rank): _rng_state()}}
        if has_optim:
            state["model"], state["optim"] = get_state_dict(trainer.model, trainer.optimizer)
        else:  # get_state_dict would make AdamW state (a step at lr 0): save none instead
            state["model"] = get_model_state_dict(trainer.model)
        stager = self.last_stager = _CopyStager()
        try:
            upload = dcp.async_save(
                state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group,
                no_dist=group is None, async_stager=stager)
        except BaseException as err:  # staging failed: no thread started
            upload = Future()
            upload.set_exception(err)
        del state  # from here only the staged copy (held by DCP's thread) exists
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-finish")
        self._inflight = self._executor.submit(self._finish, upload, stager, tmp, path,
                                               rank, group)
        if wait:
            self.wait()

    def _finish(self, upload: Future, stager: _CopyStager, tmp: Path, path: Path, rank: int,
                group: dist.ProcessGroup | None) -> str:
        """In the background: wait for DCP's write on this rank, agree with the other
        ranks that every part is written, then rank 0 renames the directory into place."""
        error = upload.exception()  # waits for the write
        del upload
        stager.release()  # the write is over: the staged copy goes, its memory back
        memory.release_cached()
        mine = None if error is None else f"rank {rank}: {one_line(error)}"
        errors = [mine]
        if group is not None:
            errors = [None] * dist.get_world_size(group)
            dist.all_gather_object(errors, mine, group=group)
        failed = [e for e in errors if e is not None]
        outcome: str | None = None
        if rank == 0:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                try:
                    swap_into_place(tmp, path)
                except OSError as err:
                    shutil.rmtree(tmp, ignore_errors=True)
                    outcome = f"rank 0 could not rename {tmp} to {path}: {err!r}"
        outcome = self._broadcast(group, outcome)
        if failed or outcome:
            disk_full = isinstance(error, OSError) and error.errno == errno.ENOSPC \
                or any("ENOSPC" in e or "No space left" in e for e in failed)
            hint = ("the disk is full: free space or save elsewhere" if disk_full
                    else "see the cause; fix it and save again")
            raise CheckpointWriteError(
                f"saving checkpoint {path} failed ({'; '.join(failed) or outcome}); its "
                f"temporary directory was removed and nothing was written under {path} "
                f"(earlier checkpoints are untouched): {hint}") from error
        return str(path)

    def poll(self) -> str | None:
        """See `PolicyTrainer.poll_checkpoint`."""
        with self._lock:
            inflight = self._inflight
        return None if inflight is None else WRITTEN if inflight.done() else WRITING

    def wait(self) -> str | None:
        """See `PolicyTrainer.wait_checkpoint`."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        try:
            return inflight.result()
        finally:
            del inflight
            memory.release_cached()

    # -- load ----------------------------------------------------------------------------

    def load(self, trainer: Trainer, path: str | os.PathLike) -> None:
        """See `PolicyTrainer.load_checkpoint`."""
        self.wait()
        self._ensure_awake(trainer, "load")
        path = Path(path).absolute()
        info = read_info(path)
        check_same_model(info, _full_shapes(trainer), path)
        group = self.group(trainer)
        rank = trainer.rank
        try:
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        except READ_ERRORS as err:
            raise CorruptCheckpointError(f"{path / METADATA} is unreadable ({err!r}); the "
                                         "checkpoint is damaged: use an earlier one") from err
        had_optim = bool(trainer.optimizer.state)
        # a fresh state dict of the trainer's structure: nothing of the trainer is written
        # until every tensor was read
        if info.get("optimizer"):
            model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        else:
            model_sd, optim_sd = get_model_state_dict(trainer.model), None
        fresh: dict[str, Any] = {"model": _empty_like(model_sd),
                                 "trainer": {"steps": torch.tensor(0)}}
        if optim_sd is not None:
            fresh["optim"] = _empty_like(optim_sd)
        del model_sd, optim_sd
        # RNG: this rank's own when the world is the same, else rank % the saved world's
        source = str(rank % int(info["world_size"]))
        # (a kind this process has but the saver had not, CUDA's, is left as it is)
        rng = {kind: torch.empty(saved[f"rng.{source}.{kind}"].size, dtype=torch.uint8)
               for kind in _rng_state() if f"rng.{source}.{kind}" in saved}
        fresh["rng"] = {source: rng}
        try:
            dcp.load(fresh, storage_reader=dcp.FileSystemReader(path), process_group=group,
                     no_dist=group is None)
        except READ_ERRORS as err:
            if not had_optim:
                trainer.optimizer.state.clear()  # undo get_state_dict's made-up state
            raise CorruptCheckpointError(
                f"cannot read checkpoint {path}: its data files are truncated, corrupt or "
                f"unreadable ({one_line(err)}); the trainer was left as it was: load an "
                "earlier checkpoint") from err
        if "optim" in fresh:
            set_state_dict(trainer.model, trainer.optimizer,
                           model_state_dict=fresh["model"], optim_state_dict=fresh["optim"])
        else:
            set_model_state_dict(trainer.model, fresh["model"])
            trainer.optimizer.state.clear()
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
        trainer.steps = int(fresh["trainer"]["steps"])
        del fresh, rng
        # what set_state_dict made (AdamW's state is now the tensors read) joins the tags,
        # as step() adopts what a step makes, so a sleep still covers it
        # (parameters as detached views: adopting the module would take their gradients
        # too, which belong to the "grads" stage)
        trainer.tenancy.adopt([p.detach() for p in trainer.model.parameters()]
                              + list(trainer.model.buffers()), "weights")
        trainer.tenancy.adopt(trainer.optimizer, "optimizer")
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        if grads:
            trainer.tenancy.adopt(grads, "grads")
        memory.release_cached()

    def close(self) -> None:
        """Finish the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
