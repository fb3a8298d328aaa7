"""The memory a burst of requests took, handed back to the system once the server is quiet.

glibc keeps the heap a burst grew: after 15 s of clients sending 2.25 MB uploads and leaving, a
server that idled at 102 MB stayed at 262 MB for good. `malloc_trim` gives back what is free
(156 MB there), in a few milliseconds: done once the server has answered nothing for
`QUIET_S`, after answering something since it last did. Probes and scrapes (`metrics.POLLED`)
are not counted: every 5 s, they kept a server from ever being quiet. An idle server does not
wake for it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from lightship.runtime.base import trim_heap

if TYPE_CHECKING:
    from lightship.serve.metrics import Metrics

QUIET_S = 5.0


async def trim_when_quiet(metrics: Metrics) -> None:
    """Run until cancelled: `trim_heap` once no request has been answered for QUIET_S after
    some were. Idle, it sleeps until the next answer (`Metrics.next_answer`), not waking."""
    loop = asyncio.get_running_loop()
    while True:
        answer = metrics.next_answer = loop.create_future()
        await answer
        seen = -1
        while seen != metrics.answered:
            seen = metrics.answered
            await asyncio.sleep(QUIET_S)
        trim_heap()
