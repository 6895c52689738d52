"""The miss runtime of an engine, built from its ``EngineConfig.miss`` (FreeToken's CPU misses and
bandwidth-adaptive split; DESIGN.md 1.2).

``fetch`` needs nothing; ``cpu`` and ``adaptive`` need a CPU expert mechanism over the model's host
banks (``ftjax.experts.cpu_experts``); ``adaptive`` also a split table, from ``fixed_fetch``, a given
cost model, or the calibration profile of this machine (``ftjax.calibrate``, calibrated quickly and
added to the profile when missing).
"""

from __future__ import annotations

from ftjax.config import MissPolicyConfig
from ftjax.experts import cpu_experts, miss_policy


def build_miss_runtime(model, miss: MissPolicyConfig, batch: int, miss_copy: str = "auto") -> miss_policy.MissRuntime:
    """The ``MissRuntime`` of ``miss`` for ``model`` (``ftjax.checkpoint.LoadedModel``) decoding ``batch`` rows.
    ``miss_copy``: the engine's ``KernelConfig.miss_copy``, under which a calibration times its fetches.

    The ``compute_on`` mechanisms read the banks inside the program, so their banks must carry the host
    memory kind in their type: ``model.banks`` is replaced by such a view where it does not.
    Raises:
      ValueError / OSError: an unreadable or malformed calibration profile.
    """
    e = model.cfg.num_experts
    if miss.policy == "fetch":
        return miss_policy.build_runtime("fetch", e)
    impl, threads = miss.cpu_impl, miss.cpu_threads or None
    if impl not in cpu_experts.CALLBACK_IMPLS:
        b = model.banks
        model.banks = b.replace(gate_up=cpu_experts.ensure_host_typed(b.gate_up),
                                down=cpu_experts.ensure_host_typed(b.down),
                                scales=None if b.scales is None else tuple(map(cpu_experts.ensure_host_typed,
                                                                               b.scales)))
    calibration, split_model = None, miss.split_model
    if miss.policy == "adaptive" and miss.fixed_fetch is None and split_model is None:
        # imported here: ``python -m ftjax.calibrate`` runs that module as __main__, which must not be imported
        # (by ``import ftjax``) before it runs
        from ftjax import calibrate

        path = miss.calibration_profile or calibrate.default_profile_path()
        entry, key, path, fresh = calibrate.profile_for(model, impl, batch, path, threads, driver=miss.cpu_driver,
                                                          miss_copy=miss_copy)
        name = calibrate.impl_key(impl, miss.cpu_driver)
        measured = entry["impls"][name]
        split_model = calibrate.split_model_from(measured)
        threads = threads or measured.get("mechanism", {}).get("threads")
        calibration = {"path": path, "key": key, "impl": name, "calibrated_now": fresh, "entry": entry}
    cpu = cpu_experts.make_cpu_experts(impl, model.banks.gate_up, model.banks.down, threads,
                                       scales=model.banks.scales, fmt=model.banks.fmt,
                                       from_program=miss.cpu_driver == "callback")
    return miss_policy.build_runtime(miss.policy, e, cpu, split_model=split_model, fixed_fetch=miss.fixed_fetch,
                                     calibration=calibration)
