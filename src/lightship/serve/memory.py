"""The memory a burst of requests took, handed back to the system once the server is quiet.

glibc keeps the heap a burst grew: after 15 s of clients sending 2.25 MB uploads and leaving, a
server that idled at 102 MB stayed at 262 MB for good. `malloc_trim` gives back what is free
(156 MB there), in a few milliseconds: done once the server has answered nothing for
`QUIET_S`, after answering something since it last did. An idle server wakes once a period
and does nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lightship.runtime.base import trim_heap

QUIET_S = 5.0


class QuietWatch:
    """When to trim, from the count of requests answered, read once a period: when it stood
    still for a period after it moved since the last trim. An idle server never is."""

    def __init__(self, answered: int) -> None:
        self.seen = self.trimmed = answered

    def due(self, answered: int) -> bool:
        due = answered == self.seen and answered != self.trimmed
        if due:
            self.trimmed = answered
        self.seen = answered
        return due


async def trim_when_quiet(answered: Callable[[], int]) -> None:
    """Run until cancelled: `trim_heap` once `answered()`, the count of requests answered,
    has stood still for QUIET_S after it moved (`QuietWatch`)."""
    watch = QuietWatch(answered())
    while True:
        await asyncio.sleep(QUIET_S)
        if watch.due(answered()):
            trim_heap()
