r"""Where a Gated DeltaNet prefill spends its time, and what the chunk-scan kernel changes (issue 32).

  PYTHONPATH=. python3 experiments/bench_gated_delta.py --out_dir=$OUT                      # on the GPU
  .venv/bin/python experiments/bench_gated_delta.py --tokens=256 --value_heads=2 --key_heads=1 \
      --head_dim=32 --tiles=16:4 --model_layers=0 --repeats=2 --out_dir=/tmp/gd               # CPU smoke

One Gated DeltaNet layer of --preset (qwen3.5-35b-a3b: 32 value heads, 16 key heads, dk = dv = 128)
on a --tokens prompt, batch 1, random inputs and weights (``--head_dim`` / ``--value_heads`` /
``--key_heads`` shrink it for a smoke run). Every row is the median (and spread) of --repeats calls of
one jitted function after a compiling call, with its compile seconds:

* ``rule``: ``chunked_gated_delta_rule`` (float32 q, k, v, g, beta, state) with the scan over chunks in
  XLA (``xla``) and as the ``gated_delta`` kernel at each of --tiles (``block_v:num_warps:num_stages``),
  with and without the per-chunk states, and with the chunk solve as a kernel too at each of
  --solve_blocks (``solve<block>+kernel``);
  ``err_o`` / ``err_state``: max |x - ref| / max |ref| against the XLA form
  under ``jax.default_matmul_precision("highest")``; ``*_highest`` rows run under that precision too.
* ``pieces``: the parts of the XLA form, each its own program: the chunk preparation (decay matrix,
  intra-chunk scores, the two triangular solves), the triangular solves alone, the scan over chunks
  alone, and the solve replaced by a matmul-only inverse of the unit lower-triangular matrix
  (``(I + L)^-1 = prod_k (I + (-L)^(2^k))``, log2(chunk) squarings) with its error against the solve,
  and the preparation with one solve of both right-hand sides side by side.
* ``layer``: the whole layer (``gated_deltanet``: projections, conv, rule, gated norm, output) in the
  model's dtype, XLA vs the scan kernel at the best tiles, alone and with the solve kernel; one decode
  token (T = 1) for scale, in XLA and with the ``causal_conv`` and ``gated_delta_step`` kernels.
* ``conv``: the short causal conv (``causal_conv``: depthwise, SiLU, the conv state in and out) over the
  --tokens prompt in the model's dtype, XLA vs the ``causal_conv`` kernel at each of --conv_tiles
  (``block_t:block_c:num_warps``); ``err_out`` / ``err_state`` against the XLA form (the reference).
* ``decode``: the one-token recurrent update (``gated_delta_decode``: q / k norms, head grouping, the
  gated delta step on the float32 state) at each of --decode_batches rows, XLA vs the ``gated_delta_step``
  kernel at each of --step_tiles (``block_v:num_warps``). One jitted call runs --decode_steps chained steps
  (the state carried, as the layers of a decode step follow each other; the state donated, so the kernel
  updates it in place); ``s`` is per call, ``s_per_step`` its median / --decode_steps. ``err_o`` /
  ``err_state`` of one step and ``err_state_chain`` after the chain against the XLA form.
* ``model`` (``--model_layers`` > 0): TTFT of a --tokens resident prefill of the preset cut to that many
  layers (random weights) with the kernels ``auto`` picks but the delta rule in XLA, with the scan kernel
  ``gated_delta`` alone (best tiles), with ``auto``'s (both kernels at their default tiles) and with both at
  the best tiles of the ``rule`` stage, the first token's logits of each against the first's; under ``auto``
  also --model_decode_steps resident decode steps after a
  --decode_prompt_len prompt (tokens/s); skipped when the run has already spent --model_deadline_s seconds.

Writes ``bench_gated_delta_<preset>[_<tag>].json`` (after every stage) and prints the tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from experiments import common  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "qwen3.5-35b-a3b", "Model shape (a preset with Gated DeltaNet layers).")
flags.DEFINE_string("dtype", "bfloat16", "The model's compute dtype (the rule itself is float32).")
flags.DEFINE_integer("tokens", 8192, "Prompt tokens.", lower_bound=2)
flags.DEFINE_integer("head_dim", None, "Override dk = dv (smoke runs).", lower_bound=1)
flags.DEFINE_integer("value_heads", None, "Override the value heads (smoke runs).", lower_bound=1)
flags.DEFINE_integer("key_heads", None, "Override the key heads (smoke runs).", lower_bound=1)
flags.DEFINE_list("tiles", ["32:4:1", "32:2:1", "16:4:1"],
                  "Kernel tiles to time, block_v:num_warps:num_stages[:operand_bits] (16: q, k and the scores stored "
                  "as float16, gated_delta.OPERAND_BITS).")
flags.DEFINE_list("solve_blocks", ["64", "32", "16"], "Solve kernel tiles to time, block[:num_warps[:form]] "
                  "(``gated_delta_solve`` tiles: diagonal blocks, 64 = the whole chunk row by row; form 0 masked, "
                  "1 blocked: ftjax.kernels.gated_delta.SOLVE_FORM).")
flags.DEFINE_list("stages", ["rule", "pieces", "layer", "conv", "decode", "model"],
                  "Stages to run (rule picks the tiles of the others).")
flags.DEFINE_list("conv_tiles", ["64:128:4", "32:256:4", "128:64:4"],
                  "``causal_conv`` tiles to time (conv stage), block_t:block_c:num_warps.")
flags.DEFINE_list("step_tiles", ["32:4", "16:4", "64:4"],
                  "``gated_delta_step`` tiles to time (decode stage), block_v:num_warps.")
flags.DEFINE_list("decode_batches", ["1", "4"], "Rows of the decode stage's one-token update.")
flags.DEFINE_integer("decode_steps", 16, "Chained one-token updates per timed call (decode stage).", lower_bound=1)
flags.DEFINE_integer("repeats", 10, "Timed calls per row.", lower_bound=1)
flags.DEFINE_integer("model_layers", 16, "Layers of the model-level prefill (0: no model stage).", lower_bound=0)
flags.DEFINE_integer("model_decode_steps", 64, "Decode steps timed in the model stage (auto kernels only; 0: none).",
                     lower_bound=0)
flags.DEFINE_integer("decode_prompt_len", 512, "Prompt tokens before those decode steps.", lower_bound=1)
flags.DEFINE_list("model_configs", ["xla-delta-rule", "auto", "auto+decode-kernels"],
                  "Kernel configurations of the model stage (the first is the logits' reference): xla-delta-rule, "
                  "gated_delta-only, auto, auto-best-tiles, auto+decode-kernels (auto plus causal_conv and "
                  "gated_delta_step, which are not auto), auto-mosaic-moe (auto without grouped_matmul_triton and "
                  "grouped_matmul_pool: the Mosaic grouped matmul over a gathered layer), auto-gather-moe (auto "
                  "without grouped_matmul_pool: the Triton matmul over a gathered layer: auto's choice at "
                  "a733c60), auto-one-tile (auto with the Triton matmul's 64-row tiles for the down matmul too, as "
                  "before 3373cb2), auto+fused-swiglu (auto plus grouped_swiglu_triton), "
                  "auto+mixer-kernel (auto plus gated_deltanet_decode: a decode token's Gated DeltaNet mixer in one "
                  "launch), auto-unfused (auto without grouped_swiglu_triton: auto before 2026-12-06), "
                  "auto-gather-out (auto without grouped_matmul_scatter: the down matmul's rows gathered back to pair "
                  "order after it, as before 2026-12-06), "
                  "auto+graphs (auto with decode_graphs=on: the decode block as a CUDA graph), auto+mgpu-attention "
                  "(auto with flash_prefill=mgpu: jax's Mosaic GPU attention in prefill, the jnp attention where "
                  "it does not serve), auto+pallas-attention (auto with flash_prefill=pallas: the Pallas flash "
                  "kernel for every prefill call, auto before 2026-12-06), auto+offset-norms "
                  "(the auto kernels by name: norm_dense_decode then also takes the zero-centred norms of the "
                  "decode layers, with their projections, as auto does since 2026-12-05: dense_decode.OFFSET_AUTO; "
                  "it times auto's choice before then when run with OFFSET_AUTO off). The "
                  "'auto+' and '-moe' configs list the auto kernels by name, so each runs wherever it takes the "
                  "operands, without auto's own conditions (minimum tokens, group counts, OFFSET_AUTO): alike for "
                  "this 8192-token prefill; in decode they run the zero-centred norm kernel too. Any of them may "
                  "end in @kernel=a:b:c... tile overrides (KernelConfig.tiles), e.g. "
                  "auto@grouped_matmul_triton=64:256:64:8:3:0.")
flags.DEFINE_list("model_decode_configs", ["auto", "auto+decode-kernels"],
                  "Model-stage configurations whose decode is timed too.")
flags.DEFINE_float("model_deadline_s", 300.0, "Skip the model stage once the run has taken this long.")
flags.DEFINE_string("tag", "", "Suffix of the JSON name.")
flags.DEFINE_string("out_dir", "experiments/results/gated_delta", "Where the JSON goes.")


def _tiles(entry: str) -> tuple[int, ...]:
    return tuple(int(x) for x in entry.split(":"))


def _time(fn, *args) -> dict:
    """Compile seconds, then the spread of --repeats calls (seconds)."""
    return common.time_calls(fn, *args, repeats=FLAGS.repeats)


_err = common.rel_err


def _cfg():
    from ftjax.config import preset
    cfg = preset(FLAGS.preset)
    over = {k: v for k, v in (("linear_key_head_dim", FLAGS.head_dim), ("linear_value_head_dim", FLAGS.head_dim),
                              ("linear_num_value_heads", FLAGS.value_heads),
                              ("linear_num_key_heads", FLAGS.key_heads)) if v}
    return dataclasses.replace(cfg, **over)


def _rule_inputs(cfg, t: int):
    import jax.numpy as jnp

    from ftjax.layers import gated_deltanet as gdn
    r = np.random.default_rng(0)
    h, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)  # noqa: E731
    q, k = gdn.l2_normalize(f(1, t, h, dk)), gdn.l2_normalize(f(1, t, h, dk))
    g = -jnp.asarray(r.uniform(0.0, 0.3, size=(1, t, h)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(1, t, h)), jnp.float32)
    return q, k, f(1, t, h, dv), g, beta, 0.1 * f(1, h, dk, dv)


def _kernels(tiles: tuple[int, ...], solve: tuple[int, ...] | None = None):
    """The scan kernel at ``tiles`` (with ``solve``: and the chunk-solve kernel at those tiles), every other op
    in XLA."""
    from ftjax.kernels.registry import KernelConfig
    if solve is None:
        return KernelConfig(use=("gated_delta",), tiles={"gated_delta": tiles})
    return KernelConfig(use=("gated_delta", "gated_delta_solve"),
                        tiles={"gated_delta": tiles, "gated_delta_solve": tuple(solve)})


def stage_rule(cfg, out: dict) -> None:
    import jax

    from ftjax.kernels.registry import KernelConfig, using
    from ftjax.layers import gated_deltanet as gdn
    args = _rule_inputs(cfg, FLAGS.tokens)

    def rule(kc: KernelConfig, states: bool):
        def fn(*a):
            with using(kc):
                return gdn.chunked_gated_delta_rule(*a, chunk_states=states)
        return jax.jit(fn)

    xla = KernelConfig(use="xla")
    with jax.default_matmul_precision("highest"):
        ref = rule(xla, True)(*args)
    rows = []

    def row(name, kc, states, highest=False):
        fn = rule(kc, states)
        with jax.default_matmul_precision("highest") if highest else contextlib.nullcontext():
            m = _time(fn, *args)
            o, s, ends = fn(*args)
        res = {"variant": name, "chunk_states": states, "highest": highest, **m, "err_o": _err(o, ref[0]),
               "err_state": _err(s, ref[1])}
        if states:
            res["err_ends"] = _err(ends, ref[2])
        rows.append(res)
        print(f"rule {name:>12} states={states!s:5} highest={highest!s:5} median {m['s']['median'] * 1e3:8.3f} ms  "
              f"compile {m['compile_s']:6.2f} s  err_o {res['err_o']:.2e}", flush=True)
        return res

    for states in (False, True):
        row("xla", xla, states)
    best = None
    for entry in FLAGS.tiles:
        tiles = _tiles(entry)
        try:
            r = row(f"kernel {entry}", _kernels(tiles), False)
        except Exception as e:  # a tile the Triton compile refuses: record it, go on
            rows.append({"variant": f"kernel {entry}", "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print(f"rule kernel {entry}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if best is None or r["s"]["median"] < best[1]:
            best = (tiles, r["s"]["median"])
    out["rule"] = rows
    if best is not None:
        out["best_tiles"] = list(best[0])
        name = "kernel " + ":".join(map(str, best[0]))
        row(name, _kernels(best[0]), True)
        best_solve = None
        for entry in FLAGS.solve_blocks:
            try:
                r = row(f"solve{entry}+{name}", _kernels(best[0], _tiles(entry)), False)
            except Exception as e:  # a block the Triton compile refuses: record it, go on
                rows.append({"variant": f"solve{entry}+{name}", "error": f"{type(e).__name__}: {str(e)[:400]}"})
                continue
            if best_solve is None or r["s"]["median"] < best_solve[1]:
                best_solve = (entry, r["s"]["median"])
        if best_solve is not None:
            out["best_solve_block"] = best_solve[0]
            row(f"solve{best_solve[0]}+{name}", _kernels(best[0], _tiles(best_solve[0])), True)
        row("xla", xla, False, highest=True)
        row(name, _kernels(best[0]), False, highest=True)


def _prep(q, k, v, g, beta, chunk: int, solve_fn, joint: bool = False):
    """The chunk preparation of the XLA form (mirrors ``chunked_gated_delta_rule``), with the triangular
    solve given as ``solve_fn(unit_lower, rhs)``; ``joint``: one solve of both right-hand sides side by side."""
    import jax.numpy as jnp
    b, t, h, dk = k.shape
    sw = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    q, k, v, g, beta = sw(q) * dk ** -0.5, sw(k), sw(v), sw(g), sw(beta)
    n = t // chunk
    ch = lambda x: x.reshape(b, h, n, chunk, *x.shape[3:])  # noqa: E731
    q, k, v, g, beta = (ch(a) for a in (q, k, v, g, beta))
    kb, vb = k * beta[..., None], v * beta[..., None]
    c = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))
    decay = jnp.exp(jnp.where(lower, c[..., :, None] - c[..., None, :], -jnp.inf))
    system = jnp.einsum("...id,...jd->...ij", kb, k) * decay
    unit = jnp.where(jnp.tril(lower, -1), system, 0.0) + jnp.eye(chunk, dtype=system.dtype)
    if joint:
        uw = solve_fn(unit, jnp.concatenate([vb, kb * jnp.exp(c)[..., None]], axis=-1))
        u, w = uw[..., :vb.shape[-1]], uw[..., vb.shape[-1]:]
    else:
        u, w = solve_fn(unit, vb), solve_fn(unit, kb * jnp.exp(c)[..., None])
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    return u, w, q * jnp.exp(c)[..., None], k * jnp.exp(c[..., -1:] - c)[..., None], intra, \
        jnp.exp(c[..., -1])[..., None, None]


def _tri_solve(unit, rhs):
    import jax
    return jax.lax.linalg.triangular_solve(unit, rhs, left_side=True, lower=True, unit_diagonal=True)


def _doubling_solve(unit, rhs):
    """(I + L)^-1 rhs with the inverse as prod_k (I + P^(2^k)), P = -L strictly lower (P^chunk = 0)."""
    import jax.numpy as jnp
    chunk = unit.shape[-1]
    eye = jnp.eye(chunk, dtype=unit.dtype)
    p = eye - unit
    inv = eye + p
    for _ in range(int(np.log2(chunk)) - 1):
        p = p @ p
        inv = inv + inv @ p
    return inv @ rhs


def stage_pieces(cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp

    from ftjax.layers import gated_deltanet as gdn
    q, k, v, g, beta, s0 = _rule_inputs(cfg, FLAGS.tokens)
    chunk = gdn.DELTA_CHUNK
    rows = []

    def row(name, fn, *args, ref=None):
        m = _time(fn, *args)
        res = {"piece": name, **m}
        if ref is not None:
            res["err"] = _err(fn(*args)[0], ref)
        rows.append(res)
        print(f"piece {name:>16} median {m['s']['median'] * 1e3:8.3f} ms  compile {m['compile_s']:6.2f} s"
              + (f"  err {res['err']:.2e}" if "err" in res else ""), flush=True)

    prep = jax.jit(functools.partial(_prep, chunk=chunk, solve_fn=_tri_solve))
    row("prep", prep, q, k, v, g, beta)
    parts = prep(q, k, v, g, beta)

    def scan(s, u, w, qr, kw, a, d):
        def step(s, xs):
            u_n, w_n, q_n, k_n, a_n, d_n = xs
            v_new = u_n - w_n @ s
            return s * d_n + jnp.swapaxes(k_n, -1, -2) @ v_new, q_n @ s + a_n @ v_new
        return jax.lax.scan(step, s, tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qr, kw, a, d)))
    row("scan", jax.jit(scan), s0, *parts)
    b, h, n = 1, cfg.linear_num_value_heads, FLAGS.tokens // chunk
    unit = jnp.tril(jax.random.uniform(jax.random.key(0), (b, h, n, chunk, chunk)) * 0.05, -1) + jnp.eye(chunk)
    rhs = jax.random.normal(jax.random.key(1), (b, h, n, chunk, cfg.linear_value_head_dim))
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(_tri_solve)(unit, rhs)
    row("triangular_solve", jax.jit(lambda u, r: (_tri_solve(u, r),)), unit, rhs, ref=exact)
    row("doubling_inverse", jax.jit(lambda u, r: (_doubling_solve(u, r),)), unit, rhs, ref=exact)
    with jax.default_matmul_precision("highest"):
        row("doubling_highest", jax.jit(lambda u, r: (_doubling_solve(u, r),)), unit, rhs, ref=exact)
    # the solve on the real system (the prep's own), then the whole prep with the doubling inverse
    row("prep_doubling", jax.jit(functools.partial(_prep, chunk=chunk, solve_fn=_doubling_solve)), q, k, v, g, beta,
        ref=parts[0])
    row("prep_joint_solve", jax.jit(functools.partial(_prep, chunk=chunk, solve_fn=_tri_solve, joint=True)),
        q, k, v, g, beta, ref=parts[0])
    out["pieces"] = rows


def stage_layer(cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp

    from ftjax.kernels.registry import KernelConfig, using
    from ftjax.layers import gated_deltanet as gdn
    dtype = jnp.dtype(FLAGS.dtype)
    r = np.random.default_rng(2)
    lp = {name: jnp.asarray(r.normal(size=shape) * (0.02 if len(shape) == 2 else 0.5), dtype)
          for name, shape in gdn.param_shapes(cfg).items()}
    lp["A_log"] = jnp.asarray(np.log(r.uniform(1, 16, size=lp["A_log"].shape)), dtype)
    lp["norm"] = jnp.ones_like(lp["norm"])
    (_, _, km1, cd), (_, _, hv, dk, dv) = gdn.state_shapes(cfg, 1, 1)
    conv0, rec0 = jnp.zeros((1, km1, cd), dtype), jnp.zeros((1, hv, dk, dv), jnp.float32)
    rows = []
    for t in (FLAGS.tokens, 1):
        x = jnp.asarray(r.normal(size=(1, t, cfg.hidden_size)), dtype)
        valid = jnp.ones((1, t), bool)
        choices = [("xla", KernelConfig(use="xla"))]
        if t > 1 and "best_tiles" in out:
            name = "kernel " + ":".join(map(str, out["best_tiles"]))
            choices.append((name, _kernels(tuple(out["best_tiles"]))))
            if "best_solve_block" in out:
                block = out["best_solve_block"]
                choices.append((f"solve{block}+{name}", _kernels(tuple(out["best_tiles"]), _tiles(str(block)))))
        if t == 1:
            choices.append(("causal_conv+gated_delta_step", KernelConfig(use=("causal_conv", "gated_delta_step"))))
        for name, kc in choices:
            def fn(x, c, s, kc=kc, valid=valid):
                with using(kc):
                    return gdn.gated_deltanet(cfg, lp, x, c, s, valid)[:3]
            m = _time(jax.jit(fn), x, conv0, rec0)
            rows.append({"tokens": t, "variant": name, **m})
            print(f"layer T={t:5} {name:>28} median {m['s']['median'] * 1e3:8.3f} ms  compile {m['compile_s']:6.2f} s",
                  flush=True)
    out["layer"] = rows


def _variant_row(stage: str, rows: list, name: str, run) -> dict | None:
    """``run()`` (a dict of measurements) recorded as row ``name`` of ``stage``; a variant the Triton
    compile refuses is recorded with its error and the stage goes on."""
    try:
        res = {"variant": name, **run()}
    except Exception as e:  # a tile the Triton compile refuses: record it, go on
        rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        print(f"{stage} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    rows.append(res)
    errs = "  ".join(f"{k} {v:.2e}" for k, v in res.items() if k.startswith("err"))
    print(f"{stage} {name:>28} median {res['s']['median'] * 1e3:8.3f} ms  compile {res['compile_s']:6.2f} s  {errs}",
          flush=True)
    return res


def stage_conv(cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp

    from ftjax.kernels.registry import KernelConfig, using
    from ftjax.layers import gated_deltanet as gdn
    dtype = jnp.dtype(FLAGS.dtype)
    r = np.random.default_rng(4)
    t, c, taps = FLAGS.tokens, cfg.linear_conv_dim, cfg.linear_conv_kernel
    x = jnp.asarray(r.normal(size=(1, t, c)), dtype)
    w = jnp.asarray(r.normal(size=(taps, c)) * 0.5, dtype)
    state = jnp.asarray(r.normal(size=(1, taps - 1, c)), dtype)  # a continued prefill (prefix reuse)
    n = jnp.asarray([t], jnp.int32)

    def conv(kc):
        def fn(*a):
            with using(kc):
                return gdn.causal_conv(*a)
        return jax.jit(fn)

    ref = conv(KernelConfig(use="xla"))(x, w, state, n)
    rows = []

    def run(kc):
        def go():
            fn = conv(kc)
            m = _time(fn, x, w, state, n)
            y, s = fn(x, w, state, n)
            return {"tokens": t, "channels": c, **m, "err_out": _err(y, ref[0]), "err_state": _err(s, ref[1])}
        return go

    _variant_row("conv", rows, "xla", run(KernelConfig(use="xla")))
    for entry in FLAGS.conv_tiles:
        _variant_row("conv", rows, f"causal_conv {entry}",
                     run(KernelConfig(use=("causal_conv",), tiles={"causal_conv": _tiles(entry)})))
    out["conv"] = rows


def stage_decode(cfg, out: dict) -> None:
    import jax
    import jax.numpy as jnp

    from ftjax.kernels.registry import KernelConfig, using
    from ftjax.layers import gated_deltanet as gdn
    dtype = jnp.dtype(FLAGS.dtype)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    steps = FLAGS.decode_steps
    rows = []
    for b in map(int, FLAGS.decode_batches):
        r = np.random.default_rng(5 + b)
        f = lambda *s, dt=dtype: jnp.asarray(r.normal(size=s), dt)  # noqa: E731
        q, k, v = f(steps, b, hk, dk), f(steps, b, hk, dk), f(steps, b, hv, dv)
        g = -jnp.asarray(r.uniform(0.0, 0.3, size=(steps, b, hv)), jnp.float32)
        beta = jnp.asarray(r.uniform(size=(steps, b, hv)), dtype)
        s0 = 0.1 * f(b, hv, dk, dv, dt=jnp.float32)

        def chain(kc):
            def fn(q, k, v, g, beta, s):  # the steps' tokens one after the other, the state carried
                with using(kc):
                    for i in range(steps):
                        o, s = gdn.gated_delta_decode(q[i], k[i], v[i], g[i], beta[i], s)
                return o, s
            return jax.jit(fn, donate_argnums=5)

        def one(kc):
            def fn(*a):
                with using(kc):
                    return gdn.gated_delta_decode(*a)
            return jax.jit(fn)

        xla = KernelConfig(use="xla")
        ref1 = one(xla)(q[0], k[0], v[0], g[0], beta[0], s0)
        ref_chain = chain(xla)(q, k, v, g, beta, s0.copy())

        def run(kc):
            def go():
                fn = chain(kc)
                s = s0.copy()
                t0 = time.perf_counter()
                s = jax.block_until_ready(fn(q, k, v, g, beta, s))[1]
                compile_s = time.perf_counter() - t0
                ts = []
                for _ in range(FLAGS.repeats):
                    t0 = time.perf_counter()
                    s = jax.block_until_ready(fn(q, k, v, g, beta, s))[1]
                    ts.append(time.perf_counter() - t0)
                spread = common.spread(ts)
                o1, s1 = one(kc)(q[0], k[0], v[0], g[0], beta[0], s0)
                _, s_chain = fn(q, k, v, g, beta, s0.copy())
                return {"batch": b, "steps": steps, "compile_s": compile_s, "s": spread,
                        "s_per_step": spread["median"] / steps, "err_o": _err(o1, ref1[0]),
                        "err_state": _err(s1, ref1[1]), "err_state_chain": _err(s_chain, ref_chain[1])}
            return go

        _variant_row("decode", rows, f"B={b} xla", run(xla))
        for entry in FLAGS.step_tiles:
            _variant_row("decode", rows, f"B={b} gated_delta_step {entry}",
                         run(KernelConfig(use=("gated_delta_step",), tiles={"gated_delta_step": _tiles(entry)})))
    out["decode"] = rows


def stage_model(cfg, out: dict, save=lambda: None) -> None:
    """The --model_layers cut's resident --tokens prefill (and decode) under each of --model_configs; ``save()``
    after each config, so a run stopped at its time limit keeps the configs it finished."""
    import jax

    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig
    from ftjax.kernels import registry
    n = FLAGS.model_layers
    cfg = dataclasses.replace(cfg, num_layers=n, layer_types=cfg.layer_types[:n])
    t0 = time.perf_counter()
    model = random_model(cfg, FLAGS.dtype)
    jax.block_until_ready(model.host_down)
    out["model_build_s"] = time.perf_counter() - t0
    # auto's kernels as a tuple, less merge_dense_decode: auto takes it for one-row calls only, a tuple naming it
    # at every batch (these presets' attention has no rope_cache, so it applies nowhere here anyway)
    auto = tuple(name for name, k in registry.kernels().items() if k.auto and name != "merge_dense_decode")
    prompt = list(np.random.default_rng(3).integers(0, cfg.vocab_size, FLAGS.tokens))
    tiles = {"gated_delta": tuple(out["best_tiles"])} if "best_tiles" in out else {}
    if "best_solve_block" in out:
        tiles["gated_delta_solve"] = _tiles(str(out["best_solve_block"]))
    gdn = ("gated_delta", "gated_delta_solve")
    known = {"xla-delta-rule": (tuple(a for a in auto if a not in gdn), {}),
             "gated_delta-only": (tuple(a for a in auto if a != "gated_delta_solve"), tiles),
             "auto": ("auto", {}), "auto-best-tiles": ("auto", tiles),
             "auto+decode-kernels": (auto + ("causal_conv", "gated_delta_step"), {}),
             "auto-mosaic-moe": (tuple(a for a in auto if a not in ("grouped_matmul_triton", "grouped_matmul_pool")),
                                 {}),
             "auto-gather-moe": (tuple(a for a in auto if a != "grouped_matmul_pool"), {}),
             "auto-one-tile": ("auto", {"grouped_matmul_triton": (64, 256, 64, 8, 3)}),
             "auto+fused-swiglu": (auto + ("grouped_swiglu_triton",), {}),
             "auto+mixer-kernel": (auto + ("gated_deltanet_decode",), {}),
             "auto-unfused": (tuple(a for a in auto if a != "grouped_swiglu_triton"), {}),
             "auto-gather-out": (tuple(a for a in auto if a != "grouped_matmul_scatter"), {}),
             "auto+graphs": ("auto", {}, {"decode_graphs": "on"}),
             "auto+mgpu-attention": ("auto", {}, {"flash_prefill": "mgpu"}),
             "auto+pallas-attention": ("auto", {}, {"flash_prefill": "pallas"}),
             "auto+offset-norms": (auto, {})}
    unknown = sorted({c.split("@")[0] for c in FLAGS.model_configs} - set(known))
    if unknown:
        raise app.UsageError(f"--model_configs: unknown {unknown}; expected some of {sorted(known)}, each with "
                             "optional @kernel=a:b:c tile overrides")
    configs = tuple(_with_tiles(name, known[name.split("@")[0]]) for name in FLAGS.model_configs)
    rows, first = [], None
    out["model"] = {"layers": n, "rows": rows}  # filled config by config; save() writes what is done so far
    for name, use, kt, *more in configs:
        kernels = registry.KernelConfig(use=use, tiles=kt, **(more[0] if more else {}))
        eng = Engine(model, EngineConfig("resident", max_seq_len=FLAGS.tokens + 16, prefill_chunk=FLAGS.tokens,
                                         kernels=kernels))
        runs = [eng.generate([prompt], 1, keep_logits=True) for _ in range(1 + min(FLAGS.repeats, 5))]
        logits = np.asarray(runs[-1].step_logits[0])
        first = logits if first is None else first
        ttft = common.spread([r.ttft_s for r in runs[1:]])
        rows.append({"kernels": name, "ttft_s": ttft, "compile_s": eng.compile_s,
                     "compile_log": [{"step": n_, "lower_s": lo, "xla_s": xc} for n_, lo, xc in eng.programs.log],
                     "err_logits_vs_first": _err(logits, first)})
        print(f"model {n} layers {name:>24}: TTFT median {ttft['median']:.4f} s, compile {eng.compile_s:.1f} s "
              f"({eng.programs.lower_s:.1f} s tracing and lowering), "
              f"logits vs {configs[0][0]} {rows[-1]['err_logits_vs_first']:.2e}", flush=True)
        if FLAGS.model_decode_steps and name in FLAGS.model_decode_configs:
            short = prompt[:FLAGS.decode_prompt_len]
            tps = [eng.generate([short], FLAGS.model_decode_steps).decode_tokens_per_s
                   for _ in range(1 + min(FLAGS.repeats, 3))][1:]
            rows[-1]["decode_tokens_per_s"] = common.spread(tps)
            print(f"model {n} layers {name:>24}: decode {common.spread(tps)['median']:.1f} tok/s", flush=True)
        del eng, runs
        save()


def _with_tiles(name: str, config: tuple) -> tuple:
    """(name, use, tiles, *more) of a --model_configs entry ``base@kernel=a:b:c@...``: the base config's with each
    named kernel's tiles overridden (``KernelConfig.tiles``; the kernel's parser refuses bad values)."""
    use, kt, *more = config
    kt = dict(kt)
    for spec in name.split("@")[1:]:
        kernel, _, vals = spec.partition("=")
        try:
            kt[kernel] = tuple(int(v) for v in vals.split(":"))
        except ValueError:
            raise app.UsageError(f"--model_configs: {name!r}: expected @kernel=a:b:c (integers), got {spec!r}")
    return (name, use, kt, *more)


def main(argv):
    del argv
    import jax
    t_start = time.perf_counter()
    cfg = _cfg()
    name = f"bench_gated_delta_{FLAGS.preset}" + (f"_{FLAGS.tag}" if FLAGS.tag else "") + ".json"
    out = {"shape": {"tokens": FLAGS.tokens, "value_heads": cfg.linear_num_value_heads,
                     "key_heads": cfg.linear_num_key_heads, "dk": cfg.linear_key_head_dim,
                     "dv": cfg.linear_value_head_dim}, "device": jax.devices()[0].device_kind, "partial": True}
    for key, stage in (("rule", stage_rule), ("pieces", stage_pieces), ("layer", stage_layer), ("conv", stage_conv),
                       ("decode", stage_decode)):
        if key in FLAGS.stages:
            stage(cfg, out)
            common.write_json(FLAGS.out_dir, name, out)
    if FLAGS.model_layers and "model" in FLAGS.stages:
        if time.perf_counter() - t_start < FLAGS.model_deadline_s:
            stage_model(cfg, out, lambda: common.write_json(FLAGS.out_dir, name, out))
        else:
            out["model"] = {"skipped": f"the run had taken {time.perf_counter() - t_start:.0f} s"}
    out["partial"] = False
    print("wrote", common.write_json(FLAGS.out_dir, name, out))


if __name__ == "__main__":
    common.run(main)
