"""Serving: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

* ``ftjax.serve.scheduler`` -- :class:`Scheduler`: requests into engine batch rows, one engine step at a
  time (continuous batching), token events out;
* :mod:`ftjax.serve.server` -- :func:`~ftjax.serve.server.create_app`: the FastAPI app (``/v1/completions``,
  ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``) driving one scheduler from one
  background thread;
* :mod:`ftjax.serve.text` -- incremental detokenization and stop strings; :mod:`ftjax.serve.chat` -- chat
  templates; :mod:`ftjax.serve.metrics` -- the Prometheus metrics;
* ``python -m ftjax.serve`` -- the command (``ftjax/serve/__main__.py``).

The scheduler's names are re-exported here; the web framework is imported only by ``server``.
"""

from ftjax.serve.scheduler import QueueFull, RequestStats, SamplingParams, Scheduler, TokenEvent

__all__ = ["QueueFull", "RequestStats", "SamplingParams", "Scheduler", "TokenEvent"]
