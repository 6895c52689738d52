r"""Generate text with an MoE model whose experts live in host memory.

  python -m ftjax.generate                                   # demo model and prompt, expert cache on
  python -m ftjax.generate --checkpoint=DIR --prompt="Hello" --max_new_tokens=32
  python -m ftjax.generate --preset=qwen3-30b-a3b --vram_budget_gb=8 --prompt_len=512
  python -m ftjax.generate --preset=qwen3.5-35b-a3b --vram_budget_gb=8 --prompt_len=512   # hybrid DeltaNet
  python -m ftjax.generate --checkpoint=DIR --prompts_file=reqs.jsonl --kv_offload --metrics_json=m.json

With --prompts_file, the requests (JSON lines ``{"prompt_ids": [...]}`` or ``{"prompt": "..."}``)
run one after another in this process (batch 1); with --kv_offload, full 256-token chunks of
their prompts' KV are kept in host memory and a later request sharing a prefix reuses it
(layerwise load inside the prefill scan; DESIGN.md 1.4). --metrics_json then has a ``requests``
list and a ``kv_store`` object.

With neither --checkpoint nor --preset the demo model is the trained one committed at
``ftjax/assets/stdlib_moe`` (experiments/train_moe.py; a Python-source model) with a built-in Python
prompt, or, where that directory is absent, random weights at preset 'tiny'. The demo keeps an
expert cache of 2E slots, smaller than its pool.

Sampling: --temperature, --top_p and --top_k left unset take the checkpoint's generation_config.json
defaults (do_sample false or absent: greedy); a line says which were applied.

Prints the memory plan, the sampling used, the text (or ids), TTFT, prefill and decode tokens/s and the
expert-cache hit rate and host-to-device bytes. Errors (bad files, bad flags, ids outside the vocabulary)
print one line and exit with status 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

from absl import flags

from ftjax import absl_app, engine_flags
from ftjax.engine_flags import UserError

FLAGS = flags.FLAGS
# The model, expert-cache, quantization, kernel, miss-policy and KV-offload flags (shared with ftjax.serve).
engine_flags.define_flags()
flags.DEFINE_string("prompt", None, "Prompt text (needs tokenizer.json in the checkpoint).")
flags.DEFINE_list("prompt_ids", None, "Prompt token ids, comma separated.")
flags.DEFINE_integer("prompt_len", None, "A random prompt of this many tokens (any model; without a prompt flag the "
                     "demo model continues its built-in prompt, any other gets 16 random tokens).")
flags.DEFINE_integer("batch", 1, "Decode this many copies of the prompt together; stdout and --logits_npy show "
                     "the first, the metrics JSON's batch_generated_ids holds every one.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate per sequence.")
flags.DEFINE_float("temperature", None, "Sampling temperature; 0 = greedy. Default: the checkpoint's "
                   "generation_config.json (its temperature when do_sample is true, else greedy).")
flags.DEFINE_float("top_p", None, "Nucleus sampling mass in (0, 1]. Default: the checkpoint's, else 1.")
flags.DEFINE_integer("top_k", None, "Keep the k most likely tokens; 0 = no limit. Default: the checkpoint's, "
                     "else 0.")
flags.DEFINE_integer("max_seq_len", None, "KV cache length; default prompt + new tokens rounded up to 128.")
flags.DEFINE_string("metrics_json", None, "Write metrics (ids, TTFT, tokens/s, expert_cache) to this file.")
flags.DEFINE_string("logits_npy", None, "Write float32 [steps, vocab] logits of every generated step (of the first "
                    "sequence: one step per token it emitted, none after its EOS).")
flags.DEFINE_string("trace_routing", None, "Write routed expert ids per step and layer (.npz): the prefill, then each "
                    "decode step up to the last token emitted, and the model's num_layers, num_experts and top_k.")
flags.DEFINE_string("prompts_file", None, "JSON lines (UTF-8, a byte-order mark allowed; blank lines skipped), each "
                    "{\"prompt_ids\": [...]} or {\"prompt\": \"...\"}: requests run in order in this process "
                    "(batch 1), after every line was checked (an error names the file and line; nothing runs).")
flags.DEFINE_boolean("ignore_eos", False, "Generate --max_new_tokens tokens even past the checkpoint's EOS id(s) "
                     "(benchmarks). Without it each sequence stops at its first EOS id (generation_config.json's, "
                     "else config.json's).")




def _atomic_write(path: str, write) -> None:
    """Writes through a temporary file in the same folder, then renames: no half-written files."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"cannot write {path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the user's usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# The default demo: the trained model (experiments/train_moe.py) and a prompt it continues.
DEFAULT_CHECKPOINT = engine_flags.DEFAULT_CHECKPOINT
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def _load_model():
    """The model of the flags (``engine_flags.load_model``), the demo being this module's DEFAULT_CHECKPOINT;
    what the checkpoint has that is ignored is printed as one warning line each."""
    return engine_flags.load_model(DEFAULT_CHECKPOINT, program="ftjax.generate")


def is_demo_checkpoint(path: str) -> bool:
    """Whether ``path`` names the bundled demo model, however it is spelled (relative, absolute, through a link)."""
    return os.path.realpath(path) == os.path.realpath(DEFAULT_CHECKPOINT)


def _prompt_ids(model) -> list[int]:
    import numpy as np
    given = [x for x in (FLAGS.prompt, FLAGS.prompt_ids, FLAGS.prompt_len) if x is not None]
    if len(given) > 1:
        raise UserError("give only one of --prompt, --prompt_ids, --prompt_len")
    if FLAGS.prompt is not None:
        if model.tokenizer is None:
            raise UserError("--prompt needs a tokenizer.json in the checkpoint; use --prompt_ids")
        ids = model.tokenizer.encode(FLAGS.prompt).ids
        if not ids:
            raise UserError("--prompt encodes to no tokens")
        return ids
    if FLAGS.prompt_ids is not None:
        try:
            return [int(x) for x in FLAGS.prompt_ids]
        except ValueError:
            raise UserError(f"--prompt_ids must be integers, got {','.join(FLAGS.prompt_ids)}") from None
    if not given and is_demo_checkpoint(model.name) and model.tokenizer is not None:
        return model.tokenizer.encode(DEFAULT_PROMPT).ids
    n = FLAGS.prompt_len or 16
    return np.random.default_rng(FLAGS.seed).integers(0, model.cfg.vocab_size, n).tolist()


def _parse_prompts_file(path: str) -> list[tuple[int, str, list[int] | str]]:
    """Reads and parses --prompts_file before any model is loaded: JSON lines, each
    ``{"prompt_ids": [int, ...]}`` or ``{"prompt": str}``, in UTF-8 (a leading byte-order mark is
    skipped); blank lines are skipped. Returns (line number from 1, "prompt_ids" or "prompt", the
    ids or the text) per request, in order.

    Raises:
      UserError: an unreadable file, a line that is not UTF-8, malformed JSON, neither or both keys,
        ids that are not integers, text that is not a string, or no requests; the message starts
        with ``PATH:LINE:`` where a line is at fault.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read prompts file ({e})") from None
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark (Windows editors write one)
        data = data[3:]
    entries = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: malformed JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("prompt_ids" in obj) == ("prompt" in obj):
            raise UserError(f"{where}: expected an object with exactly one of 'prompt_ids' or 'prompt'")
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise UserError(f"{where}: 'prompt_ids' must be a list of integers")
            entries.append((n, "prompt_ids", ids))
        else:
            if not isinstance(obj["prompt"], str):
                raise UserError(f"{where}: 'prompt' must be a string")
            entries.append((n, "prompt", obj["prompt"]))
    if not entries:
        raise UserError(f"{path}: no requests in the prompts file")
    return entries


def _check_prompts_file(path: str, entries, model, max_new_tokens: int, max_seq_len: int | None = None
                        ) -> list[list[int]]:
    """The token ids of each parsed request (:func:`_parse_prompts_file`), every one checked
    before any runs.

    Args:
      max_seq_len: the --max_seq_len given, or None: the bound of prompt + ``max_new_tokens`` is the
        smaller of it and the model's max_position_embeddings.
    Raises:
      UserError ``PATH:LINE: ...``: text without a tokenizer, an empty prompt, ids outside [0, V),
        or a prompt plus ``max_new_tokens`` beyond the bound.
    """
    from ftjax.runtime.plan import prompt_error
    v, tok = model.cfg.vocab_size, model.tokenizer
    limit, limit_name = model.cfg.max_position_embeddings, "the model's max_position_embeddings"
    if max_seq_len is not None and max_seq_len < limit:
        limit, limit_name = max_seq_len, "--max_seq_len"
    prompts = []
    for n, kind, value in entries:
        where = f"{path}:{n}"
        if kind == "prompt":
            if tok is None:
                raise UserError(f"{where}: 'prompt' needs a tokenizer.json in the checkpoint; use 'prompt_ids'")
            value = tok.encode(value).ids
        problem = prompt_error(value, v, max_new_tokens, limit, limit_name)
        if problem:
            raise UserError(f"{where}: {problem}")
        prompts.append(value)
    return prompts


def _read_prompts_file(path: str, model, max_new_tokens: int, max_seq_len: int | None = None) -> list[list[int]]:
    """:func:`_parse_prompts_file` then :func:`_check_prompts_file`: the token ids of every request
    of --prompts_file, all checked. Raises UserError (``PATH:LINE: ...`` where a line is at fault)."""
    return _check_prompts_file(path, _parse_prompts_file(path), model, max_new_tokens, max_seq_len)


def _run_metrics(model, engine, plan, sampling) -> dict:
    """The metrics fields every run writes: model, engine config, memory plan, sampling (the parameters used
    and the checkpoint's defaults), expert cache, and where the run happened (commit, device, versions,
    date) and with which flags."""
    from ftjax.provenance import run_meta
    return {"model": model.name, "weights_fingerprint": model.fingerprint, "config": model.cfg.identity(),
            "dtype": model.dtype,
            "experts": {"format": model.banks.fmt, "expert_dtype": FLAGS.expert_dtype,
                        "storage_dtype": str(model.banks.gate_up.dtype), "expert_bytes": model.expert_bytes},
            "experts_mode": engine.mode, "engine": engine.describe(),
            # what "auto" chose: prefill calls run by each driver (the prefix copy settings apply to pipelined ones)
            "prefill_driver_calls": dict(engine.prefill_driver_calls),
            "memory_plan": plan.as_dict() if plan else None,
            "sampling": {**dataclasses.asdict(sampling), "checkpoint_defaults": model.sampling_defaults.stated()},
            "expert_cache": engine.expert_cache_metrics(), "meta": run_meta(),
            "flags": {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}}


def _run_requests(model, engine, plan, prompts: list[list[int]], eos, sampling) -> dict:
    """Runs the requests one after another (batch 1), with prefix reuse when --kv_offload."""
    manager = engine_flags.kv_manager()
    requests, results = [], []
    for i, p in enumerate(prompts):
        res = engine.generate([p], FLAGS.max_new_tokens, sampling.temperature, sampling.top_p, FLAGS.seed,
                              kv_manager=manager, eos_ids=eos, top_k=sampling.top_k)
        reused = res.kv["reused_tokens"] if res.kv else 0
        requests.append({"prompt_tokens": len(p), "generated_ids": res.generated_ids[0], "ttft_s": res.ttft_s,
                         "reused_tokens": reused, "decode_s": res.decode_s,
                         "decode_tokens_per_s": res.decode_tokens_per_s, "stop_reason": res.stop_reasons[0],
                         "expert_cache": res.expert_cache, "kv": res.kv})
        results.append(res)
        text = f" | text: {model.tokenizer.decode(res.generated_ids[0])!r}" if model.tokenizer is not None else ""
        print(f"request {i}: {len(p)} prompt tokens, {reused} reused | TTFT {res.ttft_s * 1e3:.1f} ms | "
              f"decode {res.decode_tokens_per_s:.2f} tokens/s{text}")
        print(f"request {i} generated ids:", ",".join(map(str, res.generated_ids[0])))
    for note in engine.kernel_notes():
        print(f"note: {note}")
    kv_store = manager.metrics() if manager else None
    if kv_store:
        print(f"kv store: {kv_store['chunks_hit']} chunks hit, {kv_store['chunks_stored']} stored, "
              f"{kv_store['chunks_evicted']} evicted, {kv_store['chunks_skipped']} skipped; "
              f"{kv_store['bytes_loaded'] / 1e6:.1f} MB loaded, {kv_store['bytes_stored'] / 1e6:.1f} MB stored")
    metrics = {**_run_metrics(model, engine, plan, sampling), "requests": requests, "kv_store": kv_store,
               "compile_s": sum(r.compile_s for r in results)}
    if len(prompts) == 1:  # the single-prompt fields, as without --kv_offload
        r = results[0]
        metrics.update(prompt_ids=prompts[0], generated_ids=r.generated_ids[0],
                       batch_generated_ids=r.generated_ids, ttft_s=r.ttft_s, decode_s=r.decode_s,
                       prefill_tokens_per_s=r.prefill_tokens_per_s, decode_tokens_per_s=r.decode_tokens_per_s)
    if FLAGS.metrics_json:
        _atomic_write(FLAGS.metrics_json, lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    return metrics


def _check_flags() -> None:
    """Rejects flag values that would fail late or silently (before any model is loaded, so a
    bad output path costs nothing and no output is half-written)."""
    from ftjax.sampling import check_sampling
    try:
        check_sampling(0.0 if FLAGS.temperature is None else FLAGS.temperature,
                       1.0 if FLAGS.top_p is None else FLAGS.top_p, 0 if FLAGS.top_k is None else FLAGS.top_k)
    except ValueError as e:
        raise UserError(f"need a finite --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0: {e}") from None
    engine_flags.check_flags()
    for name in ("prompt_len", "max_seq_len"):
        v = FLAGS[name].value
        if v is not None and v < 1:
            raise UserError(f"--{name} must be >= 1, got {v}")
    for name in ("metrics_json", "logits_npy", "trace_routing"):
        path = FLAGS[name].value
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UserError(f"--{name}={path}: not a writable file path (folder must exist)")


def run() -> dict:
    """Runs the command; returns the metrics dict."""
    import numpy as np
    if FLAGS.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be >= 1, got {FLAGS.max_new_tokens}")
    if FLAGS.batch < 1:
        raise UserError(f"--batch must be >= 1, got {FLAGS.batch}")
    _check_flags()
    requests_mode = FLAGS.prompts_file is not None or FLAGS.kv_offload
    if requests_mode:
        if FLAGS.batch != 1:
            raise UserError("--prompts_file and --kv_offload run one request at a time: use --batch=1")
        if FLAGS.logits_npy or FLAGS.trace_routing:
            raise UserError("--logits_npy and --trace_routing are not supported with --prompts_file/--kv_offload")
        if FLAGS.kv_chunk_tokens < 1 or FLAGS.kv_host_gb < 0:
            raise UserError("need --kv_chunk_tokens >= 1 and --kv_host_gb >= 0")
        if FLAGS.prompts_file and any(x is not None for x in (FLAGS.prompt, FLAGS.prompt_ids, FLAGS.prompt_len)):
            raise UserError("give --prompts_file or one of --prompt, --prompt_ids, --prompt_len, not both")
    entries = _parse_prompts_file(FLAGS.prompts_file) if FLAGS.prompts_file else None  # before the load
    model = _load_model()
    cfg = model.cfg
    prompts = (_check_prompts_file(FLAGS.prompts_file, entries, model, FLAGS.max_new_tokens, FLAGS.max_seq_len)
               if FLAGS.prompts_file else None)
    prompt = prompts[0] if prompts else _prompt_ids(model)
    longest = max(len(p) for p in prompts) if prompts else len(prompt)
    need = longest + FLAGS.max_new_tokens
    max_seq_len = FLAGS.max_seq_len or min(-(-need // 128) * 128, cfg.max_position_embeddings)
    if need > cfg.max_position_embeddings:
        raise UserError(f"prompt of {longest} tokens + {FLAGS.max_new_tokens} new exceeds the model's "
                        f"max_position_embeddings {cfg.max_position_embeddings}")
    probe_prompts = [max(prompts, key=len)] if prompts else [prompt] * FLAGS.batch
    engine, plan = engine_flags.build_engine(model, max_seq_len, probe_prompts, FLAGS.batch)
    miss = engine.miss if engine.miss.policy != "fetch" else None
    eos = () if FLAGS.ignore_eos else model.eos_token_ids
    sampling = model.sampling_defaults.resolve(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k)
    print(sampling.describe())
    if requests_mode:
        return _run_requests(model, engine, plan, prompts or [prompt], eos, sampling)
    res = engine.generate([prompt] * FLAGS.batch, FLAGS.max_new_tokens, sampling.temperature, sampling.top_p,
                          FLAGS.seed, keep_logits=bool(FLAGS.logits_npy), trace_routing=bool(FLAGS.trace_routing),
                          eos_ids=eos, top_k=sampling.top_k)
    gen = res.generated_ids[0]
    if model.tokenizer is not None:
        print("prompt:", model.tokenizer.decode(prompt))
        print("text:", model.tokenizer.decode(gen))
    print("generated ids:", ",".join(map(str, gen)), f"(stopped: {res.stop_reasons[0]})")
    ec = engine.expert_cache_metrics()
    print(f"TTFT {res.ttft_s * 1e3:.1f} ms | prefill {res.prefill_tokens_per_s:.1f} tokens/s | "
          f"decode {res.decode_tokens_per_s:.2f} tokens/s | compile {res.compile_s:.1f} s (excluded)")
    # on_demand keeps no cache between steps: a hit rate of 0 would read as a cache that never hits
    cache = ("experts on demand (no cache kept between steps)" if ec["mode"] == "on_demand" else
             f"expert cache: {ec['slots']} slots, hit rate {ec['hit_rate']:.3f} "
             f"(decode {ec['decode']['hit_rate']:.3f})")
    print(f"{cache}, {ec['misses']} misses, "
          f"{ec['bytes_h2d'] / 1e6:.1f} MB host-to-device"
          + (f", {ec['bytes_d2d'] / 1e6:.1f} MB device-to-device ({ec['d2d_copies']} cached experts into streamed "
             f"layers)" if ec["d2d_copies"] else "")
          + (f"; decode: {ec['decode']['prefetch_copies']} copied by the prefetch ({ec['decode']['prefetch_used']} "
             f"routed), hit rate over routed experts {ec['decode']['routed_hit_rate']:.3f}, "
             f"{ec['decode']['lookup_hit_rate']:.3f} with the prefetch's right guesses" if ec["prefetch_copies"]
             else ""))
    if miss is not None:
        print(f"misses: {ec['fetched']} fetched, {ec['cpu_computed']} computed on the CPU "
              f"({ec['miss_policy']}, split {ec['split']['rule']})")
    for note in engine.kernel_notes():
        print(f"note: {note}")
    metrics = {**_run_metrics(model, engine, plan, sampling), "prompt_ids": prompt,
               "generated_ids": gen, "batch_generated_ids": res.generated_ids, "stop_reasons": res.stop_reasons,
               "ttft_s": res.ttft_s, "decode_s": res.decode_s, "prefill_tokens_per_s": res.prefill_tokens_per_s,
               "decode_tokens_per_s": res.decode_tokens_per_s, "compile_s": res.compile_s}
    if FLAGS.logits_npy:
        logits = res.step_logits[: len(gen), 0, :].astype(np.float32)  # [steps, vocab]: sequence 0's tokens
        _atomic_write(FLAGS.logits_npy, lambda f: np.save(f, logits))
    if FLAGS.trace_routing:
        from ftjax import routing_trace
        routing = routing_trace.arrays(res.routing, cfg)
        _atomic_write(FLAGS.trace_routing, lambda f: np.savez_compressed(f, **routing))
        metrics["trace_routing"] = FLAGS.trace_routing
    if FLAGS.metrics_json:
        _atomic_write(FLAGS.metrics_json, lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    return metrics


def main(argv):
    engine_flags.run_command("ftjax.generate", argv, run)


if __name__ == "__main__":
    absl_app.run(main, argv=engine_flags.alias_no_flags(sys.argv))
