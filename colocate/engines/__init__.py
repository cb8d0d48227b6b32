"""Engines: the tenants an RL loop puts on shared slots.

- `llama`: a small Llama-style causal LM with Hugging Face names, saved as a HF directory.
- `tokenizer`: a character tokenizer, saved in Hugging Face format.
- `sampling`: `SamplingParams` and `Completion`, the same for every generator engine.
"""
