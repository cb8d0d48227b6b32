"""`VLLMGenerator.close()` on CUDA wakes what sleeps before the engine shuts down (vLLM's
CuMemAllocator would unmap a sleeping allocation a second time). vLLM's sleep mode is CUDA
only, so its engine is stood in for by a recorder of the calls; the order is what counts."""

from __future__ import annotations

import pytest

vllm_generator = pytest.importorskip("colocate.engines.vllm_generator")
vllm_sleep = pytest.importorskip("colocate.engines.vllm_sleep")


class _Recorder:
    def __init__(self):
        self.calls = []
        self.llm_engine = self
        self.engine_core = self

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def shutdown(self):
        self.calls.append(("shutdown",))


def test_close_on_cuda_wakes_sleeping_stages_before_shutdown():
    llm = _Recorder()
    stages = object.__new__(vllm_sleep.NativeSleep)
    stages.llm, stages.awake = llm, {"weights"}  # the cache sleeps (a partial sleep)
    gen = object.__new__(vllm_generator.VLLMGenerator)
    gen.llm, gen.tenancy, gen._tags = llm, stages, []
    gen.close()
    assert llm.calls == [("wake_up", ("kv_cache",)), ("shutdown",)]
