"""Tickets of the asynchronous host expert kernels (``submit`` returns one, ``result`` redeems it).

A ticket crosses the jitted step as an int32 (``ftjax.experts.cpu_experts.CpuExperts.launch``'s
``io_callback`` result), so the kernels' counters wrap within [0, :data:`TICKETS`) instead of overflowing
it after 2**31 calls (about 10 days of a server with CPU misses on every layer).
"""

from __future__ import annotations

from typing import Iterator

#: Tickets are ints in [0, TICKETS).
TICKETS = 2**31


def next_ticket(counter: Iterator[int]) -> int:
    """The next ticket of ``counter`` (an ``itertools.count``), wrapped into [0, :data:`TICKETS`)."""
    return next(counter) % TICKETS
