"""Accelerator kernels, each with a plain-JAX reference.

* ``grouped_matmul``: prefill expert matmul (Mosaic GPU ``ragged_dot_mgpu`` / ``ragged_dot``);
  switch ``FTJAX_GROUPED_MATMUL``.
* ``moe_decode``: fused decode expert FFN straight from the slot pool (reference:
  ``ftjax.experts.compute.gather_outputs_reference``).
* ``decode_attention``: split-K decode attention over the filled cache positions only
  (reference: ``ftjax.model.attention``, T = 1).
* ``flash_prefill``: causal GQA flash attention with per-row start offsets, or jax's Mosaic GPU
  attention for calls starting at 0 (reference: ``ftjax.model.attention``).
* ``dense_decode``: the decode step's dense projections (wq, wk, wv, wo, router) as a GEMV that
  reads the weights stacked over layers in place; ``norm_dense_decode`` in the same module: the
  RMSNorm and several of those projections in one launch (reference: ``model.rms_norm`` then
  ``x @ w[layer]``); ``merge_dense_decode``: the wo projection with decode attention's split merge in
  its prologue (reference: ``decode_attention.merge_splits`` then the product; by name only).
* ``rope_cache``: decode attention's prologue, the q/k norms, RoPE and the K/V cache write in one
  launch (reference: ``model._qk`` and the cache scatter of ``model.attention_inputs``).
* ``slot_lookup``: the cached mode's LRU slot-table lookup of a decode layer (reference:
  ``ftjax.experts.slot_table.lookup_layer``).
* ``route_decode``: a decode layer's router after ``norm_dense_decode``'s partial logits, softmax and
  top-k in one launch (reference: ``model.top_k_route``; by name only).

All but ``grouped_matmul`` are chosen at trace time by ``FTJAX_KERNELS`` (``select``): kernels on
GPUs by default (the dense ones and ``rope_cache`` for 16-bit weights; ``merge_dense_decode`` and
``route_decode`` only when named), the jnp references on the CPU.
"""
