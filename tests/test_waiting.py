"""`services.waiting.Changes`: waits end on a change, from this loop, another loop or a
plain thread; a change between a look and the wait is not lost; timeouts hold."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.waiting import Changes

pytestmark = pytest.mark.timeout(60)


async def test_a_change_ends_a_wait_on_the_same_loop():
    changes = Changes()
    since = changes.version
    waiter = asyncio.ensure_future(changes.wait(since, 5.0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    changes.notify()
    assert await asyncio.wait_for(waiter, 1.0) is True


async def test_a_change_before_the_wait_is_not_lost():
    changes = Changes()
    since = changes.version  # looked at the state here...
    changes.notify()  # ...then it changed before the wait began
    start = time.monotonic()
    assert await changes.wait(since, 5.0) is True
    assert time.monotonic() - start < 0.1


async def test_a_wait_without_a_change_times_out():
    changes = Changes()
    start = time.monotonic()
    assert await changes.wait(changes.version, 0.1) is False
    assert 0.09 <= time.monotonic() - start < 1.0
    assert await changes.wait_for(lambda: False, 0.1) is False


async def test_changes_from_other_threads_and_loops_wake_the_waiter():
    changes = Changes()
    state = {"done": 0}

    def from_a_thread() -> None:
        for _ in range(3):
            time.sleep(0.02)
            state["done"] += 1
            changes.notify()

    def from_another_loop() -> None:  # e.g. the blocking `phase`'s helper loop
        async def run() -> None:
            await asyncio.sleep(0.02)
            state["done"] += 1
            changes.notify()

        asyncio.run(run())

    threads = [threading.Thread(target=from_a_thread),
               threading.Thread(target=from_another_loop)]
    for thread in threads:
        thread.start()
    assert await changes.wait_for(lambda: state["done"] == 4, 5.0) is True
    for thread in threads:
        thread.join()


def test_a_waiter_on_another_loop_is_woken_from_this_one():
    changes = Changes()
    result: list[bool] = []
    since = changes.version
    waiting = threading.Event()

    def wait_there() -> None:
        async def run() -> bool:
            task = asyncio.ensure_future(changes.wait(since, 5.0))
            await asyncio.sleep(0)
            waiting.set()
            return await task

        result.append(asyncio.run(run()))

    thread = threading.Thread(target=wait_there)
    start = time.monotonic()
    thread.start()
    assert waiting.wait(5.0)
    changes.notify()
    thread.join(5.0)
    assert result == [True] and time.monotonic() - start < 2.0


async def test_a_waiter_cancelled_as_a_change_lands_stays_cancelled():
    """A cancel and a notify in the same loop iteration: the waiter ends cancelled (a
    group restart cancels a step whose routed call waits; it must not go on waiting)."""
    changes = Changes()
    waiter = asyncio.ensure_future(changes.wait(changes.version, 60))
    await asyncio.sleep(0)  # it waits now
    changes.notify()  # its wake-up is scheduled...
    waiter.cancel()  # ...and so is the cancellation
    with pytest.raises(asyncio.CancelledError):
        await waiter
