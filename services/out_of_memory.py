"""A call that ran out of memory: the replica's tenant asked for more than its slot had
free (`SlotOutOfMemoryError`: past a CPU slot's capacity, or CUDA's out-of-memory, which
tenants report as one). The service has the tenant's arbiters make that room once (they
learn the larger need for every later wake of it) and routes the call again; a second
refusal, or room that cannot be made, reaches the caller as a `SlotOutOfMemoryError` that
names the service, the tenant, the bytes asked and the bytes free. Nothing is lost: the
refused call changed nothing, and a room that cannot be made moves nothing.
"""

from __future__ import annotations

from colocate.arbiter.errors import SwitchError
from colocate.memory import SlotOutOfMemoryError
from colocate.resources.manager import ResourceManager


def refused(service: str, tenant: str, err: SlotOutOfMemoryError, why: str
            ) -> SlotOutOfMemoryError:
    """The caller's error: `err`, with who asked and why it was not tried again."""
    return SlotOutOfMemoryError(
        f"service {service!r}: {tenant} asked for {err.asked_bytes} bytes with "
        f"{err.free_bytes} free ({err}); {why}", err.asked_bytes, err.free_bytes)


async def make_room(rm: ResourceManager, service: str, tenant: str,
                    err: SlotOutOfMemoryError) -> None:
    """Have `tenant`'s arbiters learn its need and make the room (see module)."""
    try:
        await rm.make_room(tenant, err.asked_bytes)
    except SwitchError as cannot:
        raise refused(service, tenant, err, f"no room could be made: {cannot}") from None
