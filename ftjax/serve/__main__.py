r"""Serve an MoE model over HTTP with OpenAI's API (completions, chat, streaming), experts in host memory.

  python -m ftjax.serve                                      # the demo model on http://127.0.0.1:8000
  python -m ftjax.serve --checkpoint=DIR --port=8080 --max_batch=8 --max_waiting=64
  python -m ftjax.serve --checkpoint=DIR --vram_budget_gb=8 --kv_offload --kv_host_gb=16

The model, expert-cache, quantization, kernel, miss-policy and KV-offload flags are ``ftjax.generate``'s
(``ftjax.engine_flags``); without --checkpoint or --preset the demo model is served (the trained
``ftjax/assets/stdlib_moe``, with an expert cache of 2E slots). The engine runs --max_batch rows of
--max_seq_len tokens (default: min(max_position_embeddings, 2048)); --max_waiting more requests may queue,
beyond that requests get HTTP 429. Routes, errors and metrics: ``ftjax.serve.server``.

Bad flags or files print one line and exit with status 1.
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

from ftjax import absl_app, engine_flags
from ftjax.engine_flags import UserError

FLAGS = flags.FLAGS
engine_flags.define_flags()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "TCP port to listen on.")
flags.DEFINE_integer("max_batch", 8, "Requests decoded together: the engine's batch rows (EngineConfig.batch).")
flags.DEFINE_integer("max_waiting", 64, "Requests that may wait for a row beyond the free rows; more get HTTP 429.")
flags.DEFINE_boolean("run_ahead", True, "Dispatch the next decode step before reading this step's tokens, so that "
                     "the host's work overlaps the device's (ftjax.serve.scheduler); --norun_ahead reads each step's "
                     "tokens first.")
flags.DEFINE_boolean("mixed_calls", False, "While a request prefills, decode the running requests' tokens in its "
                     "prefill call (one call a step) rather than in a decode call of their own: one call fewer per "
                     "prefill chunk, but in bfloat16 a running request's greedy tokens may then differ from its run "
                     "alone (ftjax.serve.scheduler).")
flags.DEFINE_integer("max_seq_len", None, "Tokens per row, prompt + generation (the KV cache length); default "
                     "min(max_position_embeddings, 2048).")
flags.DEFINE_string("served_model_name", None, "The model name of /v1/models and of requests; default the "
                    "checkpoint folder's name (or the preset's).")
flags.DEFINE_boolean("warmup", True, "Run two short requests before listening, so that the first client does not "
                     "wait for compilation.")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"], "uvicorn's log level.")

#: The default demo model (a module attribute, so that tests can point it elsewhere).
DEFAULT_CHECKPOINT = engine_flags.DEFAULT_CHECKPOINT
DEFAULT_MAX_SEQ_LEN = 2048


def _check_flags() -> None:
    """Rejects bad values before anything is loaded.
    Raises:
      UserError: the message names the flag."""
    engine_flags.check_flags()
    if FLAGS.max_batch < 1:
        raise UserError(f"--max_batch must be >= 1, got {FLAGS.max_batch}")
    if FLAGS.max_waiting < 1:
        raise UserError(f"--max_waiting must be >= 1, got {FLAGS.max_waiting}")
    if FLAGS.max_seq_len is not None and FLAGS.max_seq_len < 2:
        raise UserError(f"--max_seq_len must be >= 2, got {FLAGS.max_seq_len}")
    if not 0 <= FLAGS.port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {FLAGS.port}")
    _check_port_free(FLAGS.host, FLAGS.port)


def _check_port_free(host: str, port: int) -> None:
    """Binds (host, port) once and lets go, so that a port in use is refused before the model loads (uvicorn
    would find it only after the load and the warm-up). Port 0 (any free port) is not checked.
    Raises:
      UserError: the address cannot be bound (in use, or not an address of this machine)."""
    if port == 0:
        return
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"--host={host}: not an address of this machine ({e})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds (TIME_WAIT is fine)
        try:
            sock.bind(addr)
        except OSError as e:
            raise UserError(f"--host={host} --port={port}: cannot listen there ({e.strerror or e}); "
                            f"pick another --port") from None


def _warmup(scheduler, max_seq_len: int) -> float:
    """Runs two 2-token requests through ``scheduler``, one after the other: a 1-token prompt and a prompt
    of the shortest prefill bucket (16 tokens), so that the programs of short prompts (the routed experts
    loaded on demand, and whole layers streamed) and of decode are compiled. Returns the seconds.
    Raises:
      RuntimeError: a warm-up request failed."""
    from ftjax.runtime.plan import MIN_BUCKET
    from ftjax.serve.scheduler import SamplingParams
    t0 = time.perf_counter()
    for i, n in enumerate(sorted({1, max(1, min(MIN_BUCKET, max_seq_len - 2))})):
        rid = scheduler.submit([0] * n, SamplingParams(max_tokens=2, temperature=0.0), request_id=f"warmup-{i}")
        while scheduler.has_work():
            for ev in scheduler.step():
                if ev.request_id == rid and ev.finish_reason == "error":
                    raise RuntimeError(f"the warm-up request failed: {ev.error}")
    return time.perf_counter() - t0


def build():
    """Loads the model and builds (app, scheduler, served name) from the flags.
    Raises:
      UserError, ConfigError, CheckpointError, ValueError, OSError: bad flags or files."""
    from ftjax.serve.chat import ChatTemplate
    from ftjax.serve.scheduler import Scheduler
    try:
        from ftjax.serve.server import create_app
    except ModuleNotFoundError as err:  # the HTTP stack is the [serve] extra's
        raise UserError(f"the server needs the serve extra ({err.name} is not installed): "
                        "pip install -e '.[serve]'") from None
    _check_flags()
    model = engine_flags.load_model(DEFAULT_CHECKPOINT, program="ftjax.serve")
    cfg = model.cfg
    max_seq_len = FLAGS.max_seq_len or min(cfg.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    if max_seq_len > cfg.max_position_embeddings:
        raise UserError(f"--max_seq_len={max_seq_len} exceeds the model's max_position_embeddings "
                        f"{cfg.max_position_embeddings}")
    probe = [[0] * min(max_seq_len - 1, FLAGS.prefill_chunk)] * FLAGS.max_batch  # the largest prefill call
    engine, _ = engine_flags.build_engine(model, max_seq_len, probe, FLAGS.max_batch)
    tokenizer = model.tokenizer
    scheduler = Scheduler(engine, max_batch=FLAGS.max_batch, max_waiting=FLAGS.max_waiting,
                          kv_manager=engine_flags.kv_manager(), run_ahead=FLAGS.run_ahead,
                          mixed_calls=FLAGS.mixed_calls,
                          detokenize=tokenizer.decode if tokenizer is not None else None)
    ckpt_dir = model.name if os.path.isdir(str(model.name)) else None
    chat = ChatTemplate.from_checkpoint(ckpt_dir)
    name = FLAGS.served_model_name or os.path.basename(os.path.normpath(str(model.name)))
    if tokenizer is None:
        print("note: the model has no tokenizer.json: prompts must be token ids, and answers carry no text")
    if FLAGS["decode_loop"].present:  # a shared engine flag that only generate's blocks read
        print(f"note: --decode_loop={FLAGS.decode_loop} is ignored here: the server's decode blocks end on the "
              "device's stop check (a block run ahead runs no step once a row has stopped)")
    print("chat template: " + ("plain (role: content)" if chat.is_plain else "the checkpoint's"))
    if FLAGS.warmup:
        print(f"warm-up requests: {_warmup(scheduler, max_seq_len):.1f} s (compilation included)")
    app_ = create_app(scheduler, tokenizer, name, chat_template=chat, max_context=max_seq_len,
                      vocab_size=cfg.vocab_size)
    return app_, scheduler, name


def main(argv):
    app_, _, name = engine_flags.run_command("ftjax.serve", argv, build)
    import uvicorn
    print(f"serving '{name}' on http://{FLAGS.host}:{FLAGS.port}/v1 (Ctrl-C stops)")
    uvicorn.run(app_, host=FLAGS.host, port=FLAGS.port, log_level=FLAGS.log_level)


if __name__ == "__main__":
    absl_app.run(main, argv=engine_flags.alias_no_flags(sys.argv))
