"""Accelerator kernels, each with a plain-JAX reference, and the registry that chooses them.

Every kernel module registers its kernel in :mod:`ftjax.kernels.registry` (name, reference, where
it applies, whether ``auto`` picks it); ``EngineConfig.kernels`` (a ``registry.KernelConfig``)
selects which run, and is part of every compiled program's key.

* ``moe_decode``: fused decode expert FFN straight from the slot pool.
* ``decode_attention``: split-K decode attention over the filled cache positions only.
* ``flash_prefill``: causal GQA flash attention with per-row start offsets, and jax's Mosaic GPU
  attention for the calls starting at 0 on a Hopper GPU (``KernelConfig.flash_prefill``).
* ``dense_decode``: the decode step's dense projections read from weights stacked over layers;
  ``norm_dense_decode``: the RMSNorm and several of those projections in one launch;
  ``merge_dense_decode``: the wo projection with decode attention's split merge in its prologue (auto for
  one-row calls: batch-1 decode).
* ``rope_cache``: decode attention's prologue (q/k norms, RoPE, the K/V cache write).
* ``slot_lookup``: the cached mode's LRU slot-table lookup of a decode layer.
* ``route_decode``: a decode layer's router after ``norm_dense_decode``'s partial logits.
* ``grouped_matmul``: the prefill expert matmul (on GPUs ``grouped_matmul_triton`` for 256 experts or
  more, the Mosaic GPU kernel for fewer; ``ragged_dot`` elsewhere; ``KernelConfig.grouped_matmul``).
  ``grouped_matmul_triton``: the matmul over a tile schedule computed once per call (no per-tile search over
  the groups); ``grouped_swiglu_triton``: its gate-up with the token gather and SwiGLU fused;
  ``grouped_matmul_pool``: both reading the layer's experts in the slot pool in place (auto where the first is).
* ``causal_conv``, ``gated_delta``, ``gated_delta_solve``, ``gated_delta_step``: the Gated DeltaNet layer's
  conv, chunk scan, chunk solve and decode step (the last by name only); ``gated_deltanet_decode``: a decode
  token's whole Gated DeltaNet mixer in one launch.

Which of them ``auto`` picks on a GPU is each registry entry's ``auto`` (``registry.kernels()``); by name only:
``gated_delta_step``, ``grouped_matmul_scatter``.

``common`` holds the helpers they share (Pallas backend notes, tile checks).
"""
