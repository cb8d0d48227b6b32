"""Errors a service raises to its callers."""


class ServiceError(RuntimeError):
    """Base class of the service layer's errors."""


class ServiceAsleepError(ServiceError):
    """No replica of the service is awake (and the policy said not to wait or wake)."""


class ServiceUnavailableError(ServiceError):
    """No healthy replica is left to take the request."""


class ServiceClosedError(ServiceError):
    """The service was shut down; it takes no new requests."""


class ReplicaLostError(ServiceError):
    """The replica failed while the call was in flight (its proc died, or its actors
    failed): the call's result is lost. A routed call is retried on another replica; a
    fanout raises it to its caller."""


class ReplicaHungError(ReplicaLostError):
    """A call did not answer within its bound (`ServiceConfig.call_timeout_s`, or the
    endpoint's `colocate.bounded`): its replica counts as hung, its procs were killed, and
    it comes back as after a crash (respawn or group restart)."""


class WeightSyncError(ServiceError):
    """A weight sync that cannot work as asked; refused before anything was switched."""
