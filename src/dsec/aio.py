"""asyncio helpers shared by every part of dsec."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """`asyncio.wait_for` without Python 3.11's lost cancellation: there, a task cancelled
    just as the awaited thing finished got the result and carried on, not cancelled (a
    close that waited on it could wait forever; see cpython gh-86296, fixed in 3.12 by
    this same construction). Here the awaitable runs in the calling task under
    `asyncio.timeout`: a cancel is never swallowed. Raises TimeoutError when `timeout`
    (seconds; None: none) passes first, having cancelled `aw`."""
    async with asyncio.timeout(timeout):
        return await aw
