"""Layer pieces by kind, and the registry of token-mixer kinds a family's layers are built from.

Every decoder layer is ``h + mixer(norm(h))`` then ``h + moe(norm(h))`` (``ftjax.model.decoder_layer``).
The MoE block is the same for every layer (``moe``; with or without a shared expert); the token
mixer is the layer's *kind*:

* ``attention``: grouped-query attention with RoPE (``attention.mix``);
* ``gated_attention``: its gated variant of Qwen3.5 (``attention.mix(gated=True)``);
* ``gated_deltanet``: the Gated DeltaNet linear-attention layer (``gated_deltanet.mix``).

A family lists the kind of each of its layers (``ftjax.families``); the drivers run any pattern.
Each kind's weights are stacked over the layers of that kind, and so is its state in the
``ftjax.seams.KVCache`` (``state``: which cache fields it owns).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One token-mixer kind.

    name: the kind's name; param_shapes(cfg) -> {weight name: shape of one layer's weight};
    mix(cfg, lp, h, idx, cache, inputs, kv_hook, hook_xs, hook_carry) -> (h, cache, hook carry,
    hook output); state: the ``KVCache`` fields it owns (("k", "v") or ("conv", "rec"));
    projections: its weights used only through ``layers.common.project`` (a decode step may hand
    them over stacked, for the dense decode kernel); reads_stacked_norms: it reads ``attn_norm`` through
    ``norm_project`` (so the norm kernel may take it stacked) and the per-head q/k norms through
    ``rope_cache``.
    """

    name: str
    param_shapes: Callable
    mix: Callable
    state: tuple[str, ...]
    projections: tuple[str, ...]
    reads_stacked_norms: bool = False


@functools.cache
def kinds() -> dict[str, LayerKind]:
    """The registered layer kinds by name."""
    from ftjax.layers import attention, gated_deltanet
    return {
        "attention": LayerKind("attention", attention.param_shapes, attention.mix, ("k", "v"),
                               ("wq", "wk", "wv", "wo"), reads_stacked_norms=True),
        "gated_attention": LayerKind("gated_attention", functools.partial(attention.param_shapes, gated=True),
                                     functools.partial(attention.mix, gated=True), ("k", "v"),
                                     ("wq", "wk", "wv", "wo")),
        "gated_deltanet": LayerKind("gated_deltanet", gated_deltanet.param_shapes, gated_deltanet.mix,
                                    ("conv", "rec"), ("w_qkv", "w_z", "w_b", "w_a", "w_out")),
    }


def get(name: str) -> LayerKind:
    """The layer kind ``name``.
    Raises:
      ValueError: unknown kind (the message lists the known ones)."""
    known = kinds()
    if name not in known:
        raise ValueError(f"unknown layer kind {name!r}; expected one of {', '.join(known)}")
    return known[name]
