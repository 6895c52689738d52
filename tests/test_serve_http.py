"""The OpenAI-compatible server (ftjax.serve.server) end to end: uvicorn in a background thread of this
process, the real ``openai`` client and httpx against it, the scheduler over an engine on the tiny
``qwen3_moe_fp32`` fixture (a copy with a chat template added, so that chat goes through jinja2).

Greedy answers are compared with the engine's own ``Engine.generate`` on the same prompt ids (a separate
resident engine of batch 1). Also: incremental detokenization and chat templates (no server), bad requests
(400), a full queue (429, on a scheduler stand-in that never admits), a client that disconnects
mid-stream (its row freed), an engine step that fails (500 / an error event, then the next request is
served), the metrics, and many tiny requests leaving nothing tracked behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import json
import os
import re
import socket
import shutil
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import run_module_app
from conftest import fixture_path

from ftjax import Engine, EngineConfig, load_checkpoint
from ftjax.checkpoint import load_tokenizer
from ftjax.serve.chat import ChatTemplate, ChatTemplateError
from ftjax.serve import scheduler as scheduler_lib
from ftjax.serve.scheduler import QueueFull, Scheduler
from ftjax.serve.server import create_app
from ftjax.serve.text import TextStream

MODEL = "tiny-qwen3-moe"
MAX_SEQ_LEN = 64
# Compact (the fixture's tokenizer has 384 tokens): chat prompts stay in the completions' 16-token bucket.
CHAT_TEMPLATE = ("{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot start with a tool "
                 "message') }}{% endif %}{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
                 "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
PROMPTS = ["def main(argv):", "import os", "hello world", "class A:"]


@contextlib.contextmanager
def serving(app):
    """Runs ``app`` under uvicorn in a background thread on a free port; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_for(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class Served:
    """The module's server and what the tests compare it with."""

    def __init__(self, ckpt: str, url: str, app, scheduler, model, ref_engine):
        self.ckpt, self.url, self.app, self.scheduler, self.model = ckpt, url, app, scheduler, model
        self.tok = model.tokenizer
        self.ref_engine = ref_engine
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        self._refs: dict = {}

    @property
    def worker(self):
        return self.app.state.server.worker

    def ref_ids(self, ids: list[int], n: int) -> list[int]:
        """The engine's own greedy ids for prompt ``ids`` (stopping at the checkpoint's EOS)."""
        key = (tuple(ids), n)
        if key not in self._refs:
            res = self.ref_engine.generate([ids], n, eos_ids=self.model.eos_token_ids)
            self._refs[key] = res.generated_ids[0]
        return self._refs[key]

    def ref_text(self, prompt: str, n: int) -> tuple[list[int], str]:
        ids = self.ref_ids(self.tok.encode(prompt).ids, n)
        return ids, self.tok.decode(ids)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "qwen3_moe_fp32")
    shutil.copytree(fixture_path("qwen3_moe_fp32"), ckpt)
    with open(os.path.join(ckpt, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(ckpt, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    model = load_checkpoint(ckpt, progress=False)
    e = model.cfg.num_experts
    engine = Engine(model, EngineConfig("cached", num_slots=2 * e, max_seq_len=MAX_SEQ_LEN, batch=4))
    scheduler = Scheduler(engine, max_batch=4, max_waiting=64, detokenize=model.tokenizer.decode)
    app = create_app(scheduler, model.tokenizer, MODEL, chat_template=ChatTemplate.from_checkpoint(ckpt))
    ref_engine = Engine(model, EngineConfig(max_seq_len=MAX_SEQ_LEN))
    with serving(app) as url:
        yield Served(ckpt, url, app, scheduler, model, ref_engine)


# ---- no server ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fixture_tokenizer():
    return load_tokenizer(fixture_path("qwen3_moe_fp32"))


def test_text_stream_holds_back_partial_characters_and_stop_strings():
    tok = load_checkpoint(fixture_path("qwen3_moe_fp32"), progress=False).tokenizer
    text = "héllo wörld 你好 ok"
    ids = tok.encode(text).ids
    stream = TextStream(tok.decode)
    pieces = [stream.add(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == text == stream.text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") >= 3  # the multi-byte characters' first bytes were held back
    # a stop string: not returned, nothing after it; a possible start of one is held back meanwhile
    stream = TextStream(tok.decode, stop=["wör", "zzz"])
    pieces = [stream.add(t) for t in ids]
    assert stream.stopped and "".join(pieces) + stream.finish() == "héllo " == stream.text
    stream = TextStream(tok.decode, stop=["llo!"])
    assert "".join(stream.add(t) for t in ids) + stream.finish() == text and not stream.stopped


def test_text_stream_decodes_a_window_and_equals_decoding_everything():
    """Each token decodes a window of at most 2 * WINDOW ids (plus those held back by an incomplete character),
    and the text is that of decoding every id: for random ids of the byte-level fixture tokenizer (specials,
    split characters), for a decoder that drops the first token's leading space (Metaspace), and, through the
    fallback, for a decoder whose text is not local (its ``text``)."""
    import random

    from ftjax.serve.text import WINDOW
    tok = load_checkpoint(fixture_path("qwen3_moe_fp32"), progress=False).tokenizer
    rng = random.Random(0)
    vocab = [" a", "b", " c", "d", " é"]
    decoders = {"fixture": tok.decode, "metaspace": lambda ids: "".join(vocab[i] for i in ids).removeprefix(" "),
                "counted": lambda ids: f"{len(ids)}:" + "".join(vocab[i] for i in ids)}
    for name, decode in decoders.items():
        sizes = []
        for _ in range(30):
            n_vocab = tok.get_vocab_size() if name == "fixture" else len(vocab)
            ids = [rng.randrange(n_vocab) for _ in range(rng.randrange(1, 100))]
            stream = TextStream(lambda x: (sizes.append(len(x)), decode(x))[1])
            pieces = []
            for i, t in enumerate(ids):
                pieces.append(stream.add(t))
                assert stream.text == decode(ids[:i + 1]), (name, ids[:i + 1])
            if name != "counted":  # text once released stays: a decoder that rewrites it cannot be streamed
                assert "".join(pieces) + stream.finish() == decode(ids) == stream.text
        if name == "metaspace":  # no split characters: the window never holds more than 2 * WINDOW ids
            assert max(sizes) <= 2 * WINDOW
    long = "héllo wörld 你好 ok " * 40
    sizes = []
    stream = TextStream(lambda x: (sizes.append(len(x)), tok.decode(x))[1])
    assert "".join(stream.add(t) for t in tok.encode(long).ids) + stream.finish() == long
    assert max(sizes) <= 2 * WINDOW + 4


def _whole_text_stream(decode, stop, ids):
    """What a stream of ``ids`` releases when the whole text is decoded and searched at every token: (the piece
    of each token, the text, the index of the token that met a stop string or None). A stop string ends the text
    where it starts; else a token releases the text but its trailing U+FFFD and a tail that is a proper prefix
    of a stop string; after the last token (or the stop) the rest is released."""
    pieces, sent, text = [], 0, ""
    for i in range(len(ids)):
        text = decode(ids[:i + 1])
        found = [k for k in (text.find(s) for s in stop) if k >= 0]
        if found:
            text = text[:min(found)]
            pieces.append(text[sent:])
            return pieces, text, i
        end = len(text.rstrip("\ufffd"))
        end -= max((n for s in stop for n in range(1, len(s)) if text[:end].endswith(s[:n])), default=0)
        pieces.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
    return pieces, text, None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_text_stream_equals_decoding_the_whole_text(data):
    """Token by token, TextStream (windowed decoding, only the text not released searched) releases what decoding
    and searching the whole text at every token releases, stops at the same token and ends with the same text:
    random ids of the byte-level fixture tokenizer (characters split across tokens, stray bytes), stop strings
    cut from their text (spanning tokens, beginning or ending with a multi-byte character) or drawn from its
    characters and U+FFFD, decode windows of 1 to 16 ids."""
    tok = _fixture_tokenizer()
    v = tok.get_vocab_size()
    alphabet = list("ab c.é你好🙂\n")
    ids = tok.encode(data.draw(st.text(st.sampled_from(alphabet), min_size=1, max_size=40))).ids
    ids = [data.draw(st.integers(0, v - 1)) if data.draw(st.integers(0, 9)) == 0 else t for t in ids]
    ids += data.draw(st.lists(st.integers(0, v - 1), max_size=8))
    full = tok.decode(ids)
    stop = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            stop.append(full[i:i + data.draw(st.integers(1, 5))])
        else:
            stop.append(data.draw(st.text(st.sampled_from(alphabet + ["\ufffd"]), min_size=1, max_size=4)))
    want_pieces, want_text, want_stop = _whole_text_stream(tok.decode, stop, ids)
    stream = TextStream(tok.decode, stop, window=data.draw(st.sampled_from([1, 2, 3, 16])))
    pieces = []
    for i, t in enumerate(ids):
        pieces.append(stream.add(t))
        assert stream.stopped == (want_stop == i), (ids[:i + 1], stop)
        if stream.stopped:
            break
    assert pieces == want_pieces, (ids, stop)
    last = stream.finish()
    assert "".join(pieces) + last == want_text == stream.text, (ids, stop)


def test_text_stream_work_per_token_is_bounded(monkeypatch):
    """Per token, a TextStream decodes at most 3 * WINDOW ids (the window, and the next window's start when it
    moves on) and handles only the text it has not released and the new token's (not the whole text so far),
    for a long text with multi-byte characters and a stop string whose prefixes keep being held back: the ids
    decoded and the characters handled stay below a constant as the text grows."""
    from ftjax.serve import text as text_lib
    tok = _fixture_tokenizer()
    long = "héllo wörld 你好 ok " * 60
    ids = tok.encode(long).ids
    tails = []  # characters of the text handed to the stream per token
    add = text_lib.IncrementalDecoder.add

    def spy_add(self, token_id):
        tail, base = add(self, token_id)
        tails.append(len(tail))
        return tail, base

    monkeypatch.setattr(text_lib.IncrementalDecoder, "add", spy_add)
    calls = []
    stream = TextStream(lambda x: (calls.append(len(x)), tok.decode(x))[1], stop=["ok!"], window=4)
    per_token, pieces = [], []
    for t in ids:
        calls.clear()
        pieces.append(stream.add(t))
        per_token.append(sum(calls))
        assert len(stream.pending) <= 2 * 4 * 4  # held back: at most a window's characters (<= 4 bytes each)
    assert "".join(pieces) + stream.finish() == long == stream.text
    assert max(per_token) <= 3 * 4 + 4, per_token  # + the ids of a character split across tokens
    assert len(tails) == len(ids) and max(tails) <= 2 * 4 * 4 < len(long), tails


def test_streamed_chunks_are_json_dumps_of_the_chunk():
    """The chunks built from pre-encoded fields are byte for byte sse-starlette's encoding of
    ``{"data": json.dumps(chunk)}`` (what the server sent before)."""
    from sse_starlette.event import ensure_bytes

    from ftjax.serve.server import _DONE, _Chunks
    rid, model = 'cmpl-"x"é', 'mo"d\nel'
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
    for include_usage in (False, True):
        chunks = _Chunks(rid, "text_completion", 1234, model, include_usage)

        def old(choices, usage=None):
            c = {"id": rid, "object": "text_completion", "created": 1234, "model": model, "choices": choices,
                 "system_fingerprint": None}
            if include_usage:
                c["usage"] = usage
            return ensure_bytes({"data": json.dumps(c)}, "\n")
        for piece, logprobs, reason in (("héllo\n\"q\" 你", None, None), ("", lp, "stop")):
            choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": reason}
            assert chunks.choice(choice) == old([choice])
        if include_usage:  # the last chunk, sent only then
            assert chunks.usage(usage) == old([], usage)
    assert _DONE == ensure_bytes({"data": "[DONE]"}, "\n")


def test_chat_templates():
    plain = ChatTemplate()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert plain.is_plain and plain.render(msgs) == "system: Be brief.\nuser: Hi\nassistant:"
    t = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render(msgs) == "<s>s:Be brief.</s>\nu:Hi</s>\na:"
    with pytest.raises(ChatTemplateError, match="cannot start with a tool"):
        t.render([{"role": "tool", "content": "x"}])
    tok = load_checkpoint(fixture_path("qwen3_moe_fp32"), progress=False).tokenizer
    ids = t.encode(tok, msgs)
    assert ids[0] == 1 and ids.count(2) == 2  # <s> and </s> as the special tokens, not as text
    assert ChatTemplate.from_checkpoint(fixture_path("qwen3_moe_fp32")).is_plain  # the fixture has none


# ---- completions and chat ------------------------------------------------------------------------------
def test_completion_equals_engine_greedy(served):
    want_ids, want_text = served.ref_text(PROMPTS[0], 6)
    r = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    c = r.choices[0]
    assert c.text == want_text and c.model_extra["token_ids"] == want_ids
    assert c.finish_reason == ("stop" if len(want_ids) < 6 else "length")
    n_prompt = len(served.tok.encode(PROMPTS[0]).ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, len(want_ids), n_prompt + len(want_ids))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model == MODEL and r.object == "text_completion"


def test_completion_stream_equals_engine_greedy(served):
    want_ids, want_text = served.ref_text(PROMPTS[1], 6)
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == want_text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["stop" if len(want_ids) < 6 else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_ids)
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + len(want_ids)
    # without include_usage there is no usage chunk; the raw stream ends with [DONE]
    with httpx.stream("POST", f"{served.url}/v1/completions", json={
            "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    bodies = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(b["choices"][0]["text"] for b in bodies) == want_text and all("usage" not in b for b in bodies)


def test_stop_strings_end_the_text_before_them(served):
    want_ids, want_text = served.ref_text(PROMPTS[0], 6)
    stop = want_text[2:4]
    assert stop.strip() and len(want_text) > 4  # the fixture's greedy text has room for a stop string
    cut = want_text[:want_text.find(stop)]
    c = served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                         stop=[stop, "never seen"]).choices[0]
    assert c.text == cut and c.finish_reason == "stop"
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                   stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_for(lambda: served.worker.tracked == 0)


def test_token_id_prompt_and_logprobs(served):
    ids = served.tok.encode(PROMPTS[2]).ids
    want = served.ref_ids(ids, 5)
    r = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5,
                                                           "temperature": 0, "logprobs": 0}).json()
    c = r["choices"][0]
    assert c["token_ids"] == want and c["text"] == served.tok.decode(want)
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(want) and all(x <= 0 for x in lp["token_logprobs"])
    assert len(lp["tokens"]) == len(want) and lp["text_offset"][0] == 0


def test_chat_equals_engine_greedy(served):
    messages = [{"role": "system", "content": "Py"}, {"role": "user", "content": "loop"}]
    ids = ChatTemplate.from_checkpoint(served.ckpt).encode(served.tok, messages)
    assert ids[0] == 1 and len(ids) <= 16
    want = served.ref_ids(ids, 6)
    r = served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == served.tok.decode(want) and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    chunks = list(served.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == served.tok.decode(want)
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert len(lps) == len(want) and all(x.logprob <= 0 for x in lps)
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    # the template's raise_exception is the client's error
    with pytest.raises(openai.BadRequestError, match="cannot start with a tool"):
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=2)


def test_concurrent_requests_each_equal_solo(served):
    for p in PROMPTS:
        served.ref_text(p, 6)  # the references first: the reference engine is not thread-safe

    def one(p):
        return served.client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    for p, c in zip(PROMPTS, got):
        want_ids, want_text = served.ref_text(p, 6)
        assert c.model_extra["token_ids"] == want_ids and c.text == want_text, p


# ---- the other routes --------------------------------------------------------------------------------
def test_models_and_health(served):
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_SEQ_LEN
    h = httpx.get(f"{served.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert httpx.get(f"{served.url}/nowhere").status_code == 404


def test_metrics_after_requests(served):
    served.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0)
    m = served.metrics()
    for name in ("ftjax_requests_running", "ftjax_requests_waiting", "ftjax_time_to_first_token_seconds_count",
                 "ftjax_time_per_output_token_seconds_count", "ftjax_expert_cache_hits_total",
                 "ftjax_expert_cache_misses_total", "ftjax_expert_cache_hit_rate", "ftjax_expert_bytes_h2d_total",
                 "ftjax_kv_chunks_hit_total", "ftjax_kv_chunks_stored_total", "ftjax_generation_tokens_total",
                 "ftjax_prompt_tokens_total", 'ftjax_requests_total{finish_reason="length"}'):
        assert name in m, name
    assert m["ftjax_requests_running"] == 0 and m["ftjax_requests_waiting"] == 0
    finished = sum(v for k, v in m.items() if k.startswith("ftjax_requests_total{"))
    assert finished >= 1 and m["ftjax_time_to_first_token_seconds_count"] >= finished - m.get(
        'ftjax_requests_total{finish_reason="cancelled"}', 0) - m['ftjax_requests_total{finish_reason="error"}']
    assert 0 < m["ftjax_time_to_first_token_seconds_sum"] < 60 * m["ftjax_time_to_first_token_seconds_count"]
    assert m["ftjax_time_per_output_token_seconds_count"] >= 3
    assert m["ftjax_generation_tokens_total"] >= 4 and m["ftjax_prompt_tokens_total"] >= 1
    hits, misses = m["ftjax_expert_cache_hits_total"], m["ftjax_expert_cache_misses_total"]
    assert misses > 0 and abs(m["ftjax_expert_cache_hit_rate"] - hits / (hits + misses)) < 1e-9
    assert m["ftjax_expert_bytes_h2d_total"] >= misses * served.model.expert_bytes > 0  # every miss fetched


# ---- refused requests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, names", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "'n'"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, "100000"),
    ("/v1/completions", {"prompt": "x " * 40, "max_tokens": 40}, "context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_request_is_400_naming_the_field(served, path, body, names):
    key = 'ftjax_requests_rejected_total{reason="invalid"}'
    before = served.metrics()[key]
    r = httpx.post(served.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert names in err["message"] and err["type"] == "invalid_request_error", err
    assert served.worker.tracked == 0
    assert served.metrics()[key] == before + 1  # every refusal before any work is counted


def test_malformed_json_and_other_model_are_refused(served):
    r = httpx.post(f"{served.url}/v1/completions", content=b'{"prompt": "x",', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{served.url}/v1/completions", content=b'[1, 2]', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        served.client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="context"):  # the openai client's view of a too-long prompt
        served.client.completions.create(model=MODEL, prompt=[5] * MAX_SEQ_LEN, max_tokens=1)
    # a chat that fills the context alone, max_tokens left to its default: the message does not blame max_tokens
    r = httpx.post(f"{served.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x " * (4 * MAX_SEQ_LEN)}]})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "leaves no room for a new token" in msg and "max_tokens" not in msg, msg
    # a top_k beyond int32, a scheduler refusal and a lone surrogate: 400 naming their field, nothing run
    for body, param in (({"prompt": "x", "top_k": 2**31}, "top_k"), ({"prompt": "x", "stop_token_ids": [-1]},
                        "stop_token_ids"), ({"prompt": "a\ud800b"}, "prompt")):
        r = httpx.post(f"{served.url}/v1/completions", headers={"content-type": "application/json"},
                       content=json.dumps({"model": MODEL, "max_tokens": 2, **body}))  # JSON's \\ud800 escape
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{served.url}/v1/chat/completions", headers={"content-type": "application/json"},
                   content=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


class StuckScheduler:
    """A scheduler stand-in that queues up to ``max_waiting`` requests and never runs them."""

    running = 0

    def __init__(self, max_waiting: int):
        self.max_waiting, self.queue, self.cancelled = max_waiting, [], []

    @property
    def waiting(self):
        return len(self.queue)

    def submit(self, prompt_ids, params, request_id=None):
        if len(self.queue) >= self.max_waiting:
            raise QueueFull(f"{len(self.queue)} requests waiting")
        self.queue.append(request_id)
        return request_id

    def cancel(self, request_id):
        self.queue.remove(request_id)
        self.cancelled.append(request_id)

    def has_work(self):
        return False

    def step(self):
        return []

    def stats(self, request_id):
        return None

    def metrics(self):
        return {}


def test_queue_full_is_429_and_a_waiting_client_that_leaves_is_cancelled(served):
    stuck = StuckScheduler(max_waiting=1)
    app = create_app(stuck, served.tok, MODEL, max_context=MAX_SEQ_LEN, vocab_size=served.model.cfg.vocab_size)
    with serving(app) as url:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as first:
            assert first.status_code == 200 and wait_for(lambda: stuck.waiting == 1)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError, match="busy"):
                client.completions.create(model=MODEL, prompt="y", max_tokens=2)
            assert wait_for(lambda: 'ftjax_requests_waiting 1.0' in httpx.get(f"{url}/metrics").text)
        assert wait_for(lambda: stuck.waiting == 0 and len(stuck.cancelled) == 1)  # the first client left
        m = httpx.get(f"{url}/metrics").text
        assert 'ftjax_requests_rejected_total{reason="queue_full"} 1.0' in m
        assert 'ftjax_requests_total{finish_reason="cancelled"} 1.0' in m
        assert app.state.server.worker.tracked == 0


@contextlib.contextmanager
def patched_step(scheduler, step):
    """``scheduler.step`` replaced by ``step(original)`` (an instance attribute) for the body."""
    original = scheduler.step
    scheduler.step = lambda: step(original)
    try:
        yield
    finally:
        del scheduler.step


def test_client_disconnect_mid_stream_frees_the_row(served):
    cancelled = []
    real_cancel = served.scheduler.cancel

    def slow(original):
        time.sleep(0.25)
        return original()

    before = served.metrics()['ftjax_requests_total{finish_reason="cancelled"}']
    served.scheduler.cancel = lambda rid: (cancelled.append(rid), real_cancel(rid))[1]
    try:
        with patched_step(served.scheduler, slow):
            # 40 tokens: a prefill step and three decode blocks (16 steps each), more steps than the client stays
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{served.url}/v1/completions", json=body) as resp:
                first = next(ln for ln in resp.iter_lines() if ln.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert wait_for(lambda: len(cancelled) == 1 and served.worker.tracked == 0)
            assert wait_for(lambda: served.scheduler.running == 0 and not served.scheduler.has_work())
    finally:
        del served.scheduler.cancel
    assert cancelled[0].startswith("cmpl-")
    assert served.metrics()['ftjax_requests_total{finish_reason="cancelled"}'] == before + 1
    # the row is usable again
    want_ids, want_text = served.ref_text(PROMPTS[0], 6)
    assert served.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                            temperature=0).choices[0].text == want_text


def test_client_gone_before_a_non_streamed_answer_is_cancelled(served):
    cancelled = []
    real_cancel = served.scheduler.cancel

    def slow(original):
        time.sleep(0.25)
        return original()

    served.scheduler.cancel = lambda rid: (cancelled.append(rid), real_cancel(rid))[1]
    try:
        with patched_step(served.scheduler, slow):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{served.url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 40}, timeout=0.4)
            assert wait_for(lambda: len(cancelled) == 1 and served.worker.tracked == 0)
            assert wait_for(lambda: served.scheduler.running == 0 and not served.scheduler.has_work())
    finally:
        del served.scheduler.cancel


def test_failed_step_is_500_and_the_server_goes_on(served):
    def failing(original):
        raise RuntimeError("injected device failure")

    with patched_step(served.scheduler, failing):
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500 and "injected device failure" in r.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="injected device failure"):
            list(served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3, stream=True))
    assert served.worker.tracked == 0 and served.scheduler.running == 0
    want_ids, want_text = served.ref_text(PROMPTS[2], 4)
    assert served.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4,
                                            temperature=0).choices[0].text == want_text
    assert served.metrics()['ftjax_requests_total{finish_reason="error"}'] >= 2


def _live(cls_name: str) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == cls_name)


def test_many_tiny_requests_leave_nothing_tracked(served):
    """200 one-token requests (4 at a time, every 10th streamed): afterwards no route, no request record
    and no queue more than before."""
    import asyncio
    served.client.completions.create(model=MODEL, prompt="a", max_tokens=1)
    before = {c: _live(c) for c in ("_Job", "_Route", "Item", "Queue")}
    queues_before = sum(1 for o in gc.get_objects() if isinstance(o, asyncio.Queue))

    def one(i):
        body = {"model": MODEL, "prompt": [3 + i % 50, 7, 9, 11, 13], "max_tokens": 1, "stream": i % 10 == 0}
        r = http.post(f"{served.url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r

    with httpx.Client(timeout=60) as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(200)))
    assert wait_for(lambda: served.worker.tracked == 0)
    assert served.scheduler.running == 0 and served.scheduler.waiting == 0
    after = {c: _live(c) for c in before}
    assert after == before, (before, after)
    assert sum(1 for o in gc.get_objects() if isinstance(o, asyncio.Queue)) <= queues_before


# ---- the command ------------------------------------------------------------------------------------------
def test_serve_command(served, monkeypatch):
    """``python -m ftjax.serve`` builds the app from generate's flags (here a checkpoint with a chat
    template, and --mixed_calls for its scheduler) and hands it to uvicorn; bad flags are one line and status 1."""
    r = run_module_app("ftjax.serve.__main__", ["--max_batch=0"])
    assert r.returncode == 1 and "--max_batch must be >= 1" in r.stderr
    with socket.socket() as taken:  # a port in use: refused before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_module_app("ftjax.serve.__main__", [f"--port={port}", "--checkpoint=/nonexistent"])
    assert r.returncode == 1 and f"--port={port}: cannot listen there" in r.stderr and "nonexistent" not in r.stderr
    captured, made = {}, []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: captured.update(app=app, **kw))
    monkeypatch.setattr(scheduler_lib, "Scheduler", lambda *a, **kw: made.append(kw) or Scheduler(*a, **kw))
    r = run_module_app("ftjax.serve.__main__", [
        f"--checkpoint={served.ckpt}", f"--max_seq_len={MAX_SEQ_LEN}", "--max_batch=4", "--port=8123", "--noprogress",
        "--expert_slots=16", "--mixed_calls"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [kw["mixed_calls"] for kw in made] == [True]
    assert captured["port"] == 8123 and captured["host"] == "127.0.0.1"
    assert "chat template: the checkpoint's" in r.stdout and re.search(r"warm-up requests: [\d.]+ s", r.stdout)
    name = os.path.basename(served.ckpt)
    with serving(captured["app"]) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [name]
        want_ids, want_text = served.ref_text(PROMPTS[0], 3)
        got = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=3, temperature=0)
        assert got.choices[0].text == want_text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * (MAX_SEQ_LEN - 2), "max_tokens": 3})
        assert r.status_code == 400 and f"context of {MAX_SEQ_LEN} tokens" in r.json()["error"]["message"]
