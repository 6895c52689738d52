"""Compilation is excluded from the timings: after ``generate`` has compiled its programs and
warmed the sampler, nothing is compiled while TTFT and decode are on the clock (a first request
once paid the sampler's compile, ~0.6 s, inside its TTFT)."""

from __future__ import annotations

import jax
import jax.monitoring
import numpy as np
import pytest

from ftjax.checkpoint import random_model
from ftjax.config import preset
from ftjax import Engine
from ftjax.config import EngineConfig

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.mark.parametrize("temperature,top_p,batch,prompt_len",
                         [(0.0, 1.0, 1, 16), pytest.param(0.8, 1.0, 1, 16, marks=pytest.mark.slow),
                          (0.8, 0.9, 2, 16), pytest.param(0.0, 1.0, 2, 300, marks=pytest.mark.slow)])
def test_nothing_compiles_inside_the_timed_region(monkeypatch, no_compilation_cache, temperature, top_p, batch,
                                                  prompt_len):
    # every case starts cold, as a new process would (no on-disk cache either: a program loaded from
    # it would not send the backend-compile event this test watches for)
    jax.clear_caches()
    cfg = preset("tiny")
    model = random_model(cfg, "float32", seed=3)
    eng = Engine(model, EngineConfig("cached", num_slots=2 * cfg.num_experts, max_seq_len=512, batch=batch,
                                     prefill_chunk=128))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len - 7 * i).tolist() for i in range(batch)]
    timed, compiled_while_timed, compiled_before = [False], [], []

    def on_event(event, duration, **kw):
        if event == COMPILE_EVENT:
            (compiled_while_timed if timed[0] else compiled_before).append(duration)

    real_advance = eng.advance

    def advance(*a, **kw):  # the clock starts right before the first prefill step and runs to the last token
        timed[0] = True
        return real_advance(*a, **kw)

    monkeypatch.setattr(eng, "advance", advance)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        res = eng.generate(prompts, 6, temperature=temperature, top_p=top_p)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiled_before, "the listener saw no compile at all: the check would be vacuous"
    assert compiled_while_timed == [], f"{len(compiled_while_timed)} compiles inside TTFT/decode"
    assert res.compile_s > 0 and len(res.generated_ids[0]) == 6
    log = eng.programs.log  # each compiled program's tracing/lowering and XLA seconds, summing to compile_s
    assert log and all(xc > 0 for _, _, xc in log) and {n for n, lo, _ in log if lo > 0} >= {"forward_step"}
    assert sum(lo + xc for _, lo, xc in log) == pytest.approx(eng.compile_s, rel=1e-3)
    assert eng.programs.lower_s == pytest.approx(sum(lo for _, lo, _ in log))
    assert 0 < eng.programs.lower_s < eng.compile_s
