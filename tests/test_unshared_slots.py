"""A slot is what it says: a service placed without GPUs takes no slot, so the arbiter
never makes its replicas take turns with a slot's tenants (found by a port of
torchforge's service tests: such a service's fanout answered with one value, not two)."""

from __future__ import annotations

import pytest

from colocate import phase
from colocate.testing import MemoryTenant, start_runtime
from services import ServiceConfig, spawn_service

pytestmark = pytest.mark.timeout(300)


async def test_a_service_without_gpus_is_never_put_to_sleep_by_a_gpu_tenant():
    async with start_runtime(gpus_per_host=1) as rm:
        gpu = await spawn_service(ServiceConfig(resource_group="gpu"), MemoryTenant, 2, 1,
                                  name="gpu")
        plain = await spawn_service(
            ServiceConfig(num_replicas=2, with_gpus=False, resource_group="plain"),
            MemoryTenant, 2, 2, name="plain")
        async with phase(gpu):  # slot 0's tenant wakes: the plain replicas are no slot's
            answers = await plain.work.fanout(7)
        assert answers == [7, 7]
        assert all(rm.routable(name) for name in plain.tenant_names())
        assert [name for slot in (await rm.status()).values() for tenants in slot.values()
                for name in tenants] == gpu.tenant_names()  # the arbiter knows only it
        served = await plain.replicas[0].actors.work.call_one(1)
        assert served == 1
