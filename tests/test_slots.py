"""GPU slots: which GPU a slot's proc gets (by UUID, resolved on its own host) and what its
bootstrap command carries. The GPUs are injected facts here; tests/gpu checks them for real."""

from __future__ import annotations

import sys

import pytest

from colocate.resources.gpus import GPU_SLOT_ENV, Gpu, slot_gpu, visible_gpus
from colocate.resources.procs import SLOT_ENV, _slot_env, bootstrap_command

H100 = [Gpu(f"GPU-{i}aaa-{i}", "NVIDIA H100 80GB HBM3") for i in range(8)]  # PCI order
MIXED = [Gpu("GPU-0a", "NVIDIA A100"), Gpu("GPU-1b", "NVIDIA H100"), Gpu("GPU-2c", "NVIDIA A100")]


def test_slots_are_the_hosts_gpus_in_pci_order_by_uuid():
    assert visible_gpus({}, H100) == [g.uuid for g in H100]
    assert slot_gpu(3, {}, H100) == "GPU-3aaa-3"


def test_an_inherited_visible_list_narrows_and_orders_the_slots():
    env = {"CUDA_VISIBLE_DEVICES": "6,2,GPU-4aaa"}  # indices and a unique UUID prefix
    assert visible_gpus(env, H100) == ["GPU-6aaa-6", "GPU-2aaa-2", "GPU-4aaa-4"]
    assert slot_gpu(0, env, H100) == "GPU-6aaa-6"
    with pytest.raises(ValueError, match="slot 3 does not exist.*3 GPU"):
        slot_gpu(3, env, H100)
    # CUDA reads up to the first invalid entry; an empty list hides every GPU
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,9,2"}, H100) == ["GPU-1aaa-1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, H100) == []


def test_indices_of_mixed_gpus_need_pci_bus_order():
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(ValueError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        visible_gpus(env, MIXED)
    assert visible_gpus({**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, MIXED) == ["GPU-1b"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-2c"}, MIXED) == ["GPU-2c"]


def test_a_gpu_slot_proc_resolves_its_gpu_at_bootstrap(monkeypatch):
    monkeypatch.delenv("COLOCATE_TMS_HOOK_MODE", raising=False)
    assert _slot_env(2, virtual=True) == {SLOT_ENV: "2"}
    env = _slot_env(2, virtual=False)
    assert env == {SLOT_ENV: "2", GPU_SLOT_ENV: "2"}  # no raw index as CUDA_VISIBLE_DEVICES
    command = bootstrap_command(lambda point: _slot_env(point["gpus"], virtual=False))(
        {"gpus": 5})
    assert command.args[0] == "-c" and "run('monarch._src.actor.bootstrap_main', gpu_slot=True)" \
        in command.args[1]
    assert command.env[GPU_SLOT_ENV] == "5"
    plain = bootstrap_command(lambda point: _slot_env(point["gpus"], virtual=True))({"gpus": 5})
    assert "run('monarch._src.actor.bootstrap_main', gpu_slot=False)" in plain.args[1]
    assert GPU_SLOT_ENV not in plain.env


def test_gpu_slot_procs_start_in_preload_mode_when_this_process_runs_in_it(monkeypatch):
    monkeypatch.setenv("COLOCATE_TMS_HOOK_MODE", "preload")
    env = _slot_env(0, virtual=False)
    assert "torch_memory_saver_hook_mode_preload" in env["LD_PRELOAD"]
    assert env["COLOCATE_TMS_HOOK_MODE"] == "preload"
    assert "LD_PRELOAD" not in _slot_env(0, virtual=True)  # CPU procs: nothing to hook


class _FakeNvml:
    """pynvml's surface that `colocate.resources.gpus` uses, failing nvmlInit with `code`."""

    NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED = 12, 9

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, code: int | None) -> None:
        self.code, self.inits = code, 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.code is not None:
            raise self.NVMLError(self.code)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        raise self.NVMLError(15)  # NVML_ERROR_GPU_IS_LOST


@pytest.fixture
def fake_nvml(monkeypatch):
    from colocate.telemetry.nvml import nvml

    def install(code: int | None) -> _FakeNvml:
        fake = _FakeNvml(code)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        nvml.cache_clear()
        return fake

    yield install
    nvml.cache_clear()


def test_nvml_is_probed_once_and_its_absence_means_no_gpus(fake_nvml):
    from colocate.resources.gpus import nvml_available, nvml_gpus

    fake = fake_nvml(_FakeNvml.NVML_ERROR_DRIVER_NOT_LOADED)
    assert nvml_gpus() == [] and nvml_gpus() == [] and not nvml_available()
    assert fake.inits == 1


def test_a_real_nvml_error_is_named_not_taken_for_no_gpus(fake_nvml):
    from colocate.resources.gpus import NvmlError, nvml_gpus

    fake_nvml(4)  # NVML_ERROR_NO_PERMISSION
    with pytest.raises(NvmlError, match="nvmlInit failed: NVML error 4"):
        nvml_gpus()
    fake_nvml(None)  # starts, then loses the GPU
    with pytest.raises(NvmlError, match=r"nvmlDeviceGetHandleByIndex\(0\) failed"):
        nvml_gpus()
