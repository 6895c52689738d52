"""Config parsing: supported families parse, unsupported features are refused by field name."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURE_NAMES, fixture_path
from ftjax.config import ConfigError, preset
from ftjax.families import from_hf_dict, load_hf_config


def _base(name="qwen3_moe_fp32") -> dict:
    with open(fixture_path(name) + "/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_configs_parse(name):
    cfg = load_hf_config(fixture_path(name))
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.head_dim) == (3, 8, 2, 64, 16)
    assert cfg.rope_theta == 10000.0


def test_family_details():
    assert load_hf_config(fixture_path("olmoe_fp32")).qk_norm == "full"
    assert load_hf_config(fixture_path("qwen3_moe_fp32")).qk_norm == "per_head"
    mix = load_hf_config(fixture_path("mixtral_fp32"))
    assert mix.qk_norm == "none" and mix.norm_topk_prob and mix.tie_word_embeddings
    assert load_hf_config(fixture_path("qwen3_moe_bf16")).dtype == "bfloat16"


def test_legacy_keys_accepted():
    d = _base()
    d["num_experts"] = d.pop("num_local_experts")
    d["rope_theta"] = 5e5
    d.pop("rope_parameters")
    cfg = from_hf_dict(d)
    assert cfg.num_experts == 8 and cfg.rope_theta == 5e5


@pytest.mark.parametrize("field,value", [
    ("model_type", "llama"), ("mlp_only_layers", [0]), ("decoder_sparse_step", 2),
    ("use_sliding_window", True), ("rope_scaling", {"type": "yarn", "factor": 4.0}),
    ("hidden_act", "gelu"), ("attention_bias", True)])
def test_unsupported_refused_naming_field(field, value):
    d = _base()
    d[field] = value
    with pytest.raises(ConfigError, match=field):
        from_hf_dict(d)


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 0, "positive integer"), ("num_hidden_layers", 0, "positive integer"),
    ("vocab_size", -5, "positive integer"), ("moe_intermediate_size", 0, "positive integer"),
    ("rope_parameters", "default", "should be an object")])
def test_invalid_values_refused(field, value, message):
    d = _base()
    d[field] = value
    with pytest.raises(ConfigError, match=message):
        from_hf_dict(d)


def test_family_default_eps():
    d = _base("olmoe_fp32")
    del d["rms_norm_eps"]
    assert from_hf_dict(d).rms_norm_eps == 1e-5  # transformers' OLMoE default, not Qwen3's 1e-6


def test_mixtral_sliding_window_refused():
    d = _base("mixtral_fp32")
    d["sliding_window"] = 4096
    with pytest.raises(ConfigError, match="sliding_window"):
        from_hf_dict(d)


def test_missing_and_mistyped_fields():
    d = _base()
    del d["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        from_hf_dict(d)
    d = _base()
    d["num_hidden_layers"] = "3"
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        from_hf_dict(d)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_hf_config(tmp_path)


def test_presets_sizes():
    q = preset("qwen3-30b-a3b")
    assert abs(q.expert_bytes(2) / 1e6 - 9.44) < 0.01  # DESIGN.md section 4
    assert abs(q.pool_bytes(2) / 1e9 - 58.0) < 0.1
    h = preset("tiny-hybrid")  # one block: 3 Gated DeltaNet layers, 1 gated attention layer
    assert h.is_hybrid and (h.num_blocks, h.num_attention_layers, h.num_linear_layers) == (1, 1, 3)
    assert h.dtype == "float32" and h.rotary_dim == 8
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("nope")


def test_matmul_precision_follows_the_dtype_and_reaches_the_step():
    """float32 means float32: with "auto", a float32 engine lowers its dots at HIGHEST precision
    (XLA:GPU would otherwise run them as TF32); a bfloat16 engine keeps the default fast path; an
    explicit choice wins; an unknown one is refused."""
    import numpy as np

    from ftjax import Engine
    from ftjax.checkpoint import random_model
    from ftjax.config import EngineConfig, preset
    from ftjax.runtime.step import forward_step
    assert EngineConfig().precision("float32") == "highest"
    assert EngineConfig().precision("bfloat16") == "default"
    assert EngineConfig(matmul_precision="high").precision("float32") == "high"
    with pytest.raises(ValueError, match="unknown matmul precision 'tf32'"):
        EngineConfig(matmul_precision="tf32")
    for dtype, want in (("float32", True), ("bfloat16", False)):
        eng = Engine(random_model(preset("tiny"), dtype), EngineConfig(max_seq_len=32))
        args = (eng.model.params, eng.model.banks, eng.new_cache(1), eng.state, np.zeros((1, 1), np.int32),
                np.zeros(1, np.int32), np.ones(1, np.int32), ())
        text = forward_step.lower(*args, cfg=eng.cfg, opts=eng.planner.plan(1, 1, 1).opts).as_text()
        assert ("HIGHEST" in text) == want, dtype
        assert eng.describe()["matmul_precision_resolved"] == ("highest" if want else "default")


def test_decode_gemm_choices_and_resolution():
    from ftjax.config import EngineConfig
    from ftjax.kernels.registry import KernelConfig
    from ftjax.runtime.programs import CUBLAS_DECODE_OPTIONS, decode_compiler_options
    with pytest.raises(ValueError, match="decode_gemm: unknown value 'triton'"):
        EngineConfig(kernels=KernelConfig(decode_gemm="triton"))
    with pytest.raises(ValueError, match="unknown decode_gemm"):
        decode_compiler_options("cuBLAS", 1, "bfloat16", "gpu")
    assert decode_compiler_options("auto", 1, "bfloat16", "gpu") == CUBLAS_DECODE_OPTIONS
    assert dict(CUBLAS_DECODE_OPTIONS) == {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "dot-merger"}
    assert decode_compiler_options("auto", 1, "bfloat16", "cpu") == ()  # CPU programs as the oracle tests saw them
    assert decode_compiler_options("auto", 1, "float32", "gpu") == ()  # the GPU oracle runs, too
    assert decode_compiler_options("cublas", 1, "float32", "cpu") == CUBLAS_DECODE_OPTIONS
    assert decode_compiler_options("auto", 16, "bfloat16", "gpu") == ()  # a prefill call keeps XLA's GEMMs
    assert decode_compiler_options("xla", 1, "bfloat16", "gpu") == ()


def test_decode_graphs_choices_and_resolution():
    """KernelConfig.decode_graphs: "auto" puts the decode programs of offloading modes under the fetch
    miss policy on a GPU into command buffers with WHILE and CONDITIONAL (their miss loop otherwise
    waits on the host every iteration); never a prefill call, never off a GPU."""
    from ftjax.config import EngineConfig
    from ftjax.kernels.registry import KernelConfig
    from ftjax.runtime.programs import CUBLAS_DECODE_OPTIONS, GRAPH_DECODE_OPTIONS, decode_compiler_options, \
        decode_graphs_on
    with pytest.raises(ValueError, match="decode_graphs: unknown value 'yes'"):
        EngineConfig(kernels=KernelConfig(decode_graphs="yes"))
    with pytest.raises(ValueError, match="unknown decode_graphs"):
        decode_graphs_on("ON", "cached", True, "gpu")
    kinds = dict(GRAPH_DECODE_OPTIONS)["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS"} <= set(kinds)
    assert decode_graphs_on("auto", "cached", True, "gpu") and decode_graphs_on("auto", "on_demand", True, "gpu")
    assert not decode_graphs_on("auto", "resident", True, "gpu")
    assert not decode_graphs_on("auto", "cached", False, "gpu")  # CPU experts (host compute) inside: not measured
    assert decode_graphs_on("on", "resident", False, "gpu")
    assert not decode_graphs_on("on", "cached", True, "cpu")
    assert not decode_graphs_on("off", "cached", True, "gpu")
    both = decode_compiler_options("auto", 1, "bfloat16", "gpu", graphs=True)
    assert dict(both) == {**dict(CUBLAS_DECODE_OPTIONS), **dict(GRAPH_DECODE_OPTIONS)} and both == tuple(sorted(both))
    assert decode_compiler_options("xla", 1, "bfloat16", "gpu", graphs=True) == GRAPH_DECODE_OPTIONS
    assert decode_compiler_options("auto", 16, "bfloat16", "gpu", graphs=True) == ()  # prefill: XLA's defaults


def test_layer_types_must_match_num_layers():
    import dataclasses
    cfg = preset("tiny-hybrid")
    with pytest.raises(ValueError, match="layer_types has 4 entries, num_layers is 2"):
        dataclasses.replace(cfg, num_layers=2)
    cut = dataclasses.replace(cfg, num_layers=2, layer_types=cfg.layer_types[:2])
    assert cut.block_pattern == ("linear_attention",) and cut.num_blocks == 2
