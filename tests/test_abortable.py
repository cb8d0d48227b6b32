"""`Abortable`: one abort ends every await running through it, on any loop, with a fresh
error each; later runs fail at once; a caller cancelled itself stays cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from colocate.abortable import Abortable


class Closed(RuntimeError):
    pass


async def test_abort_ends_awaits_on_two_loops_with_their_own_error():
    under_way = Abortable()
    started = threading.Event()
    other: list[BaseException] = []

    def on_another_loop() -> None:
        async def wait() -> None:
            started.set()
            try:
                await under_way.run(asyncio.sleep(60))
            except Closed as err:
                other.append(err)
        asyncio.run(wait())

    thread = threading.Thread(target=on_another_loop)
    thread.start()
    here = asyncio.create_task(under_way.run(asyncio.sleep(60)))
    await asyncio.sleep(0.05)
    assert started.wait(5)
    under_way.abort(lambda: Closed("shut down"))
    with pytest.raises(Closed, match="shut down") as caught:
        await asyncio.wait_for(here, 5)
    thread.join(5)
    assert len(other) == 1 and other[0] is not caught.value
    with pytest.raises(Closed):  # and every later run
        await under_way.run(asyncio.sleep(0))


async def test_a_result_before_the_abort_is_kept_and_a_cancelled_caller_stays_cancelled():
    under_way = Abortable()
    assert await under_way.run(asyncio.sleep(0, result=7)) == 7
    caller = asyncio.create_task(under_way.run(asyncio.sleep(60)))
    await asyncio.sleep(0.01)
    caller.cancel()
    under_way.abort(lambda: Closed("shut down"))
    with pytest.raises(asyncio.CancelledError):
        await caller
