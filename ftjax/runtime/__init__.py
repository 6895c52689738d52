"""The runtime: how an engine runs a model, one module per job.

* ``step``: the one jitted step of the layer scan and its static options (``StepOptions``);
* ``programs``: the program cache (every jitted program compiled once per key) and the XLA options of
  decode programs;
* ``plan``: the per-call plan (stream or not, which driver, the options), decided once;
* ``drivers``: the layer scan and the layer-pipelined driver, each able to precompile and run a plan;
* ``transfers``: host transfers (zero-copy pinned views and the per-layer pieces the pipelined driver
  copies);
* ``misses``: the miss runtime built from ``EngineConfig.miss``;
* ``engine``: the ``Engine``, owner of the state, with a request-level API (admit / advance / release)
  and ``generate`` on it;
* ``planner``: the device-memory plan of a run (slots that fit a budget, with the workspace measured).
"""
