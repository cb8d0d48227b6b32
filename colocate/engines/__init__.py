"""Engines: the tenants an RL loop puts on shared slots.

- `llama`: a small Llama-style causal LM with Hugging Face names, saved as a HF directory.
- `tokenizer`: a character tokenizer, saved in Hugging Face format.
- `sampling`: `SamplingParams` and `Completion`, the same for every generator engine.
- `trainer`: `PolicyTrainer`, a policy with AdamW (and DDP) under memory tags.
- `generator`: `TorchGenerator`, the built-in generator over a KV cache.
- `vllm_generator`, `vllm_worker`: `VLLMGenerator`, vLLM with sleep through the arena on
  CPU (a worker extension) and vLLM's own sleep mode on CUDA.
- `weights`: weight copy by name, in-process publishing, shared-memory export.
- `actors`: `TrainerActor` and `GeneratorActor`, the engines as Monarch tenants.
"""
