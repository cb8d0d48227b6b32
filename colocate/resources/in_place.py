"""An in-place copy: targets take a source tenant's weights in their shared procs, with no
arbiter switch, for a handoff on roomy slots (`Handoffs.handoffs`).

The tenants are held as for a switch (`Switchboard.run_held`: routing to them waits, their
calls in flight drain, their switches wait for the copy, as the arbiter's slot lock makes
its own switches wait), and the copy is watched as the arbiter watches a plan
(`colocate.watching`): a rank that died would leave the others in their gathers, and one
that hangs would hold them for ever.
"""

from __future__ import annotations

import asyncio
from typing import Any

from colocate import watching
from colocate.arbiter.actor import remote_errors
from colocate.arbiter.config import ArbiterConfig
from colocate.arbiter.errors import TenantLostError
from colocate.monarch_compat import SupervisionError
from colocate.resources.hosts_view import HostsView
from colocate.resources.switching import DRAIN_LIVENESS_S, Switchboard


class InPlaceCopier:
    """Copies weights between tenants' actor meshes in their own procs (see module)."""

    def __init__(self, view: HostsView, switchboard: Switchboard,
                 config: ArbiterConfig) -> None:
        self.view = view
        self.switchboard = switchboard
        self.timeout_s = config.call_timeout_s

    async def copy(self, source: str, targets: list[str]) -> dict[str, int]:
        """Have every proc of each target take tenant `source`'s weights from its own
        process (`TenantActor.receive`: all at once, as a sharded source's gathers need);
        returns the bytes copied per target once all have ended. Every `DRAIN_LIVENESS_S`
        the tenants' procs are checked; a tenant found lost so, or whose actor failed the
        call, raises `TenantLostError`, and so do copies not done within
        `ArbiterConfig.call_timeout_s`, the source's procs taken for hung and killed
        first."""
        touched = {source, *targets}
        return await self.switchboard.run_held(
            touched, lambda: self._copy(source, targets, touched))

    async def _copy(self, source: str, targets: list[str], touched: set[str]
                    ) -> dict[str, int]:
        board, names = self.switchboard, ", ".join(targets)

        async def call(actors: Any) -> int:
            async with remote_errors():
                copied = await actors.receive.call(source)
            return sum(nbytes for _, nbytes in copied.items())

        async def check() -> None:
            if lost := await board.find_lost(touched):
                raise _lost(source, names, lost)

        async def late() -> BaseException:
            await board.kill(sorted({(host, pid) for (host, _), pid in
                                     self.view.pids[source].items()}))
            return _lost(source, names, {name: f"its procs did not answer within "
                                               f"{self.timeout_s} s (hung) and were killed"
                                         for name in targets})

        copies = asyncio.gather(*(call(self.view.actors[t]) for t in targets),
                                return_exceptions=True)
        results = dict(zip(targets, await watching.watched(
            copies, DRAIN_LIVENESS_S, check, self.timeout_s, late), strict=True))
        failed = {name: r for name, r in results.items() if isinstance(r, BaseException)}
        if not failed:
            return results  # type: ignore[return-value]
        name, err = next(iter(failed.items()))
        if lost := await board.find_lost(touched):
            raise _lost(source, names, lost) from err
        if isinstance(err, SupervisionError):  # gone before its arbiter could look
            why = (str(err).strip().splitlines() or ["its actor failed"])[-1].strip()
            raise _lost(source, names, {name: why}) from err
        raise err


def _lost(source: str, targets: str, lost: dict[str, str]) -> TenantLostError:
    return TenantLostError(f"handoff {source} -> {targets} in place: " + "; ".join(
        f"{name} lost ({why})" for name, why in lost.items()), None, tuple(lost))
