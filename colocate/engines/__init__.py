"""Engines: the tenants an RL loop puts on shared slots.

- `models`: causal LMs and tokenizers from a local Hugging Face directory (transformers),
  checked before anything is built.
- `tiny`: tiny random Llama / Qwen2 / Qwen3 directories with a character tokenizer, made
  offline (tests, benchmarks, the RL loop's default policy).
- `sampling`: `SamplingParams` and `Completion`, the same for every generator engine.
- `trainer`: `PolicyTrainer`, a policy with AdamW (DDP or FSDP2) under memory tags.
- `generator`: `TorchGenerator`, the built-in generator for any transformers causal LM.
- `sessions`: a trajectory's turns as rows of `generate` (`sessions=`), and the prefix
  counts (reused, recomputed) both generators report the same way.
- `kv_sessions`: the torch generator's per-session KV prefix cache, and batches that start
  from it.
- `vllm_generator`, `vllm_worker`: `VLLMGenerator`, vLLM with sleep through the arena on
  CPU (a worker extension) and vLLM's own sleep mode on CUDA.
- `weights`: weight streams by name (bucketed), in-process publishing, shared-memory
  export, RDMA.
- `checkpoint`: trainer checkpoints through torch.distributed.checkpoint (async, atomic,
  resharding), `CheckpointError`s.
- `checkpoint_files`: a checkpoint directory's layout, its checks and its errors.
- `export`: the trained model as a Hugging Face directory (from a trainer, or a checkpoint:
  `python -m colocate.engines.export CHECKPOINT_DIR OUT_DIR`).
- `reference`: `ReferencePolicy`, the frozen starting weights (GRPO's KL reference), a
  tenant that keeps only its weights.
- `batches`: a batch's tensors to the engine's device, and results back to CPU.
- `parallel`: joining a replica's torch.distributed group, FSDP2 sharding.
- `actors`: `TrainerActor`, `GeneratorActor` and `ReferenceActor`, the engines as Monarch
  tenants.
- `tools`: tools as users write them (functions with type hints and a docstring, their
  JSON schemas), and `ToolActor`, which calls them by name in a proc of its own.
- `compute_thread`: `ComputeThread`, where an engine actor's step runs: a thread of its
  own, whose malloc arena Monarch's threads do not share.
"""
