"""Accelerator kernels, each with a plain-JAX reference."""
