"""Know before a run what each switch will move and cost.

`forecast_slot` drives the arbiter's own decisions through a step's turns on one slot of a
declared capacity, with tenants given as stage sizes (`TenantSpec`): what sleeps at each
switch, the bytes copied to host memory and back, the slot's peak and the host copies held.
`plan_run` puts the slots together with this machine's `Rates` (calibrated, `rates.py`):
predicted switch and sync times, the peak slot and host memory, whether it all fits, and
why not. `check` holds a run's measured figures against its plan.
"""

from colocate.planning.forecast import (
    Moved,
    SlotForecast,
    Switch,
    Sync,
    TenantSpec,
    Turn,
    Wake,
    forecast_slot,
)
from colocate.planning.plan import TARGETS, Plan, check, plan_run
from colocate.planning.rates import Rates, cached_rates, calibrate, default_path, load_rates

__all__ = [
    "TARGETS", "Moved", "Plan", "Rates", "SlotForecast", "Switch", "Sync", "TenantSpec",
    "Turn", "Wake", "cached_rates", "calibrate", "check", "default_path", "forecast_slot",
    "load_rates", "plan_run",
]
