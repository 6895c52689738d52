"""ftjax: serving Mixture-of-Experts LLMs whose experts do not fit in GPU memory, in JAX.

What a notebook needs, in one import::

    import ftjax
    model = ftjax.load_checkpoint("DIR")                     # or ftjax.random_model(ftjax.preset("tiny"))
    engine = ftjax.Engine(model, ftjax.EngineConfig("cached", num_slots=2 * model.cfg.num_experts))
    result = engine.generate([prompt], max_new_tokens=32)

Kernel and program choices are ``ftjax.KernelConfig`` (``EngineConfig.kernels``); what a miss does is
``ftjax.MissPolicyConfig`` (``EngineConfig.miss``); ``ftjax.clear_programs()`` drops every compiled program.
"""

from ftjax.checkpoint import LoadedModel, load_checkpoint, random_model
from ftjax.config import EngineConfig, KVOffloadConfig, MissPolicyConfig, ModelConfig, preset
from ftjax.families import load_hf_config
from ftjax.kernels.registry import KernelConfig
from ftjax.kv.host_store import HostKVStore
from ftjax.kv.prefix_cache import PrefixCache
from ftjax.runtime.engine import Engine, GenerationResult
from ftjax.runtime.programs import clear as clear_programs

__all__ = ["Engine", "EngineConfig", "GenerationResult", "HostKVStore", "KVOffloadConfig", "KernelConfig",
           "LoadedModel", "MissPolicyConfig", "ModelConfig", "PrefixCache", "clear_programs", "load_checkpoint",
           "load_hf_config", "preset", "random_model"]
