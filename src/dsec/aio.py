"""asyncio helpers shared by every part of dsec."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """Await `aw` for at most `timeout` seconds (None: no limit); TimeoutError when it passes
    first, `aw` cancelled. What `asyncio.wait_for` is meant to be, on every Python 3.11:

    * a cancel of the caller is never swallowed (3.11's `wait_for` returned the result when a
      cancel landed as `aw` finished: a close waiting on such a task could wait forever);
    * a timeout is a TimeoutError even in a task that is already being cancelled, cleaning
      up (3.11.0-3.11.2's `asyncio.timeout`, Debian 12's Python, raised CancelledError there,
      which skipped the rest of the cleanup);
    * a future that got its result in the loop iteration the timeout fired in gives that
      result (as `asyncio.wait_for`): whatever was handed over through it is not dropped.

    `aw` runs in the calling task (no task of its own); the caller's cancel count decides
    whose cancel a CancelledError is, as 3.12's `asyncio.timeout` does."""
    if timeout is None:
        return await aw
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("dsec.aio.wait_for must be awaited in a task")
    loop = asyncio.get_running_loop()
    entry = task.cancelling()  # cancels requested before this wait are not ours to take
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    handle = loop.call_later(max(timeout, 0.0), expire)
    try:
        result = await aw
    except asyncio.CancelledError:
        if fired and task.uncancel() <= entry:  # our cancel alone
            # (a gather ends with the CancelledError our cancel gave its children: that is the
            # timeout, not a result)
            if (
                asyncio.isfuture(aw)
                and aw.done()
                and not aw.cancelled()
                and not isinstance(aw.exception(), asyncio.CancelledError)
            ):
                return aw.result()  # type: ignore[no-any-return]
            raise TimeoutError from None
        raise
    finally:
        handle.cancel()
    if fired:  # (fired, but `aw` took the cancel and still returned: not a timeout)
        task.uncancel()
    return result
