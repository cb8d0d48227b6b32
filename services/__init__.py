"""The service layer: replicated actors on colocated procs, routed only to awake replicas.

    from services import ServiceConfig, spawn_service
    gen = await spawn_service(ServiceConfig(num_replicas=2, resource_group="rl"), Generator)
    await gen.generate.route(prompt)
"""

from services.config import ServiceConfig, ServiceConfigError
from services.endpoint import ServiceEndpoint
from services.errors import (
    ReplicaHungError,
    ReplicaLostError,
    ServiceAsleepError,
    ServiceClosedError,
    ServiceError,
    ServiceUnavailableError,
    WeightSyncError,
)
from services.restart import GroupRestarts, RestartEvent, group_restarts
from services.service import Service
from services.spawn import spawn_service
from services.weight_sync import SyncReport, sync_weights

__all__ = [
    "GroupRestarts", "ReplicaHungError", "ReplicaLostError", "RestartEvent", "Service",
    "ServiceAsleepError", "ServiceClosedError", "ServiceConfig", "ServiceConfigError",
    "ServiceEndpoint", "ServiceError", "ServiceUnavailableError", "SyncReport",
    "WeightSyncError", "group_restarts", "spawn_service", "sync_weights",
]
