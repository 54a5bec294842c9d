"""dsec.aio.wait_for: a timeout like asyncio.wait_for's, and a cancel never swallowed."""

from __future__ import annotations

import asyncio
import sys
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


async def test_a_timeout_cancels_what_it_waited_for() -> None:
    sleeping = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await wait_for(sleeping, 0.01)
    assert sleeping.cancelled()
    assert await wait_for(asyncio.sleep(0, "done"), 1) == "done"
    assert await wait_for(asyncio.sleep(0, "no limit"), None) == "no limit"
    done = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await wait_for(done, 0) == 7  # (already done: no time needed, as asyncio's)
