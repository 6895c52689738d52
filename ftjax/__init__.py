"""ftjax: serving Mixture-of-Experts LLMs whose experts do not fit in GPU memory, in JAX.

What a notebook needs, in one import::

    import ftjax
    model = ftjax.load_checkpoint("DIR")                     # or ftjax.random_model(ftjax.preset("tiny"))
    engine = ftjax.Engine(model, ftjax.EngineConfig("cached", num_slots=2 * model.cfg.num_experts))
    result = engine.generate([prompt_ids], max_new_tokens=32)
"""

from ftjax.checkpoint import LoadedModel, load_checkpoint, random_model
from ftjax.config import EngineConfig, KVOffloadConfig, ModelConfig, load_hf_config, preset
from ftjax.engine import Engine, GenerationResult
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.prefix_cache import PrefixCache

__all__ = ["Engine", "EngineConfig", "GenerationResult", "HostKVStore", "KVOffloadConfig", "LoadedModel",
           "ModelConfig", "PrefixCache", "load_checkpoint", "load_hf_config", "preset", "random_model"]
