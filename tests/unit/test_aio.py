"""dsec.aio.wait_for: a timeout like asyncio.wait_for's, and on every Python 3.11 a cancel never
swallowed, a timeout in a task being cancelled still a TimeoutError, and a future's result that
arrives with the timeout not dropped."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dsec.aio import wait_for


async def _cancelled_as_it_finishes(impl: Callable[[Awaitable[Any], float], Awaitable[Any]]) -> bool:
    """Cancel a task in the same loop iteration as what it waits for finishes: whether the
    cancel reached it (False: it got the result and carried on)."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(impl(fut, 10))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # (it waits on fut now)
    fut.set_result(1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


async def test_a_cancel_as_the_awaited_finishes_is_not_lost() -> None:
    assert await _cancelled_as_it_finishes(wait_for)
    if sys.version_info < (3, 12):  # the bug it avoids, on this Python: the test can tell
        assert not await _cancelled_as_it_finishes(asyncio.wait_for)


async def test_a_timeout_in_a_task_being_cancelled_is_a_timeout() -> None:
    """Cleanup after a cancel that waits with a timeout (`with suppress(TimeoutError)`) gets its
    TimeoutError and goes on; the task still ends cancelled."""
    steps: list[str] = []

    async def child() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            try:
                await wait_for(asyncio.sleep(10), 0.02)
            except TimeoutError:
                steps.append("timed out")
            steps.append("cleaned up")
            raise

    task = asyncio.create_task(child())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["timed out", "cleaned up"]


async def test_a_result_arriving_with_the_timeout_is_kept() -> None:
    """A worker handed over through a future in the very iteration the timeout fires: returned,
    not dropped (asyncio.wait_for's behaviour, which a pool relies on)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_later(0.01, fut.set_result, "worker")
    loop.call_soon(time.sleep, 0.05)  # the loop stalls past both deadlines
    assert await wait_for(fut, 0.02) == "worker"


async def test_a_timeout_cancels_what_it_waited_for() -> None:
    sleeping = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await wait_for(sleeping, 0.01)
    assert sleeping.cancelled()
    assert await wait_for(asyncio.sleep(0, "done"), 1) == "done"
    assert await wait_for(asyncio.sleep(0, "no limit"), None) == "no limit"
    # a gather: our cancel ends it with its children's CancelledError, which is the timeout
    never = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        await wait_for(asyncio.gather(never, asyncio.sleep(10)), 0.01)
    assert never.cancelled()
    done = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await wait_for(done, 0) == 7  # (already done: no time needed, as asyncio's)
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # (nothing of its cancels left behind)
