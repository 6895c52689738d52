"""Accelerator kernels, each with a plain-JAX reference.

* ``grouped_matmul``: prefill expert matmul (Mosaic GPU ``ragged_dot_mgpu`` / ``ragged_dot``);
  switch ``FTJAX_GROUPED_MATMUL``.
* ``moe_decode``: fused decode expert FFN straight from the slot pool (reference:
  ``ftjax.experts.compute.gather_outputs_reference``).
* ``decode_attention``: split-K decode attention over the filled cache positions only
  (reference: ``ftjax.model.attention``, T = 1).
* ``flash_prefill``: causal GQA flash attention with per-row start offsets, or jax's Mosaic GPU
  attention for calls starting at 0 (reference: ``ftjax.model.attention``).

The last three are chosen at trace time by ``FTJAX_KERNELS`` (``select``): kernels on GPUs by
default, the jnp references on the CPU.
"""
