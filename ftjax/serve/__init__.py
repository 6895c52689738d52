"""Serving: continuous batching over the engine's request API (``ftjax.serve.scheduler``)."""

from ftjax.serve.scheduler import QueueFull, RequestStats, SamplingParams, Scheduler, TokenEvent

__all__ = ["QueueFull", "RequestStats", "SamplingParams", "Scheduler", "TokenEvent"]
