"""The asynchronous interface of the host expert kernels: ``submit`` returns a ticket, ``result`` redeems it.

A ticket crosses the jitted step as an int32 (``ftjax.experts.cpu_experts.CpuExperts.launch``'s
``io_callback`` result), so the kernels' counters wrap within [0, :data:`TICKETS`) instead of overflowing
it after 2**31 calls (about 10 days of a server with CPU misses on every layer).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
from typing import Iterator

import numpy as np

#: Tickets are ints in [0, TICKETS).
TICKETS = 2**31


def next_ticket(counter: Iterator[int]) -> int:
    """The next ticket of ``counter`` (an ``itertools.count``), wrapped into [0, :data:`TICKETS`)."""
    return next(counter) % TICKETS


class DriverThreadKernel:
    """Base of a host kernel whose calls run in order on one driver thread (which fans each call out to
    its own workers): :meth:`submit` hands a call over and returns a ticket at once, :meth:`result` waits
    for it; :meth:`compute` runs a call in the calling thread. Subclasses call :meth:`_start_driver` in
    ``__init__`` and define ``_call(x, fids, shape, dtype)`` -> [C, N, D] (rows past the listed ids zeros),
    where their ids are not an int32 array ``_ids``, and, with a worker pool of their own, ``_pool`` (shut
    down by :meth:`close`)."""

    _pool: concurrent.futures.Executor | None = None

    def _start_driver(self, name: str) -> None:
        self._driver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._tickets = itertools.count()

    def _ids(self, flat_ids: np.ndarray, count):
        """The first ``count`` of ``flat_ids`` as ``_call`` takes them (int32 [count])."""
        return np.array(np.asarray(flat_ids)[: int(count)], np.int32)

    def submit(self, x: np.ndarray, flat_ids: np.ndarray, count) -> int:
        """Starts ``count`` experts; returns a ticket for :meth:`result`, an int in [0, :data:`TICKETS`) (it
        travels through the step as an int32; tickets wrap). x [N, D]; flat_ids int [C]."""
        x = np.array(x)  # the caller's buffer may be reused once the callback returns
        shape = (int(np.shape(flat_ids)[0]),) + x.shape
        fut = self._driver.submit(self._call, x, self._ids(flat_ids, count), shape, x.dtype)
        ticket = next_ticket(self._tickets)
        with self._lock:
            self._pending[ticket] = fut
        return ticket

    def result(self, ticket) -> np.ndarray:
        """Waits for a ticket; returns [C, N, D] in x's dtype (rows past ``count`` are zeros).
        Raises KeyError: a ticket not pending (never issued, or already redeemed)."""
        with self._lock:
            fut = self._pending.pop(int(ticket))
        return fut.result()

    def compute(self, x: np.ndarray, flat_ids: np.ndarray, count) -> np.ndarray:
        """:meth:`submit` + :meth:`result` without the hand-off: the call runs in the calling thread.
        x [N, D]; flat_ids int [C], the first ``count`` computed. Returns [C, N, D] in x's dtype."""
        x = np.asarray(x)
        return self._call(x, self._ids(flat_ids, count), (int(np.shape(flat_ids)[0]),) + x.shape, x.dtype)

    def close(self) -> None:
        """Stops the driver thread (and the workers), after the calls submitted."""
        self._driver.shutdown(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
