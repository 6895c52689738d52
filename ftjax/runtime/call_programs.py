"""The small programs a layer-by-layer driver runs around its layers (``ftjax.runtime.drivers``' pipelined
driver, ``ftjax.runtime.host_split``): the embedding, the head, the stacking of per-layer outputs, and the
layer-index scalars and device specs they are compiled for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ftjax import memory
from ftjax import model as model_lib
from ftjax.runtime.transfers import layer_index
from ftjax.seams import LayerIndex


@jax.jit
def embed_program(params, tokens, start, valid_len):
    """``model.embed_inputs`` as its own program: (h [B, T, D], LayerInputs)."""
    return model_lib.embed_inputs(params, tokens, start, valid_len)


@functools.partial(jax.jit, static_argnames=("cfg", "opts"))
def head_program(params, h, valid_len, *, cfg, opts):
    """``model.final_logits`` as its own program: float32 logits [B, V] ([B, T, V] with ``opts.all_logits``),
    traced under the call's ``StepOptions`` (its matmul precision and kernels), as the layer scan's head is: traced
    outside them the head's product took XLA's default precision, which on a GPU may run a float32 product as TF32."""
    with opts.tracing():
        return model_lib.final_logits(params, cfg, h, valid_len, opts.all_logits)


@jax.jit
def stack(xs):
    """A list of per-layer pytrees stacked leaf by leaf: leaves [L, ...]."""
    return jax.tree.map(lambda *a: jnp.stack(a), *xs)


def device_spec(x) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype on the device (what a program is compiled for)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=memory.device_sharding())


def layer_idx(st: model_lib.Structure, l: int) -> LayerIndex:
    """Layer ``l``'s ``LayerIndex`` (its index in the stack and in its kind) as int32 [] device scalars."""
    return LayerIndex(layer_index(l), layer_index(st.kind_index[l]))
