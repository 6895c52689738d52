"""The expert storage-format registry (ftjax.experts.formats), parametrized over every registered format.

A format is one module of ``ftjax/experts/formats``; nothing here names one, so a new format file is
tested as soon as it exists: offload exact within the format (cached == resident, bit for bit, on the
smallest model), its entry consistent with the arrays it makes, and the fused decode kernel's format
list equal to the entries that claim it. Unknown names fail with a ValueError that names them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.checkpoint import random_model
from ftjax.config import EngineConfig, preset
from ftjax import Engine
from ftjax.experts import formats, quant
from ftjax.experts.state import ExpertBanks
from ftjax.kernels import moe_decode

FORMATS = formats.all_formats()
IDS = [f.expert_dtype for f in FORMATS]
PROMPTS = [[3, 17, 101, 5, 42, 7, 300, 11], [9, 8, 7]]  # two sequences: a decode step routes more experts
STEPS = 6


@pytest.fixture(scope="module")
def tiny():
    """The smallest preset with random float32 weights (4 layers, 16 experts, D = F = 128)."""
    return random_model(preset("tiny"), "float32")


# int4's cached (and streamed) logits are checked by default in tests/test_quant.py; its case here is slow
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.slow) if f.expert_dtype == "int4" else f
                                 for f in FORMATS], ids=IDS)
def test_cached_logits_bit_identical_to_resident(tiny, fmt):
    model = dataclasses.replace(tiny, banks=quant.quantize_banks(tiny.banks, fmt.expert_dtype))
    cfg = model.cfg
    assert model.banks.fmt == fmt.name
    itemsize = model.banks.gate_up.dtype.itemsize
    assert model.expert_bytes == fmt.expert_bytes(cfg.hidden_size, cfg.expert_ffn, itemsize)
    run = lambda c: Engine(model, c).generate(PROMPTS, STEPS, keep_logits=True)  # noqa: E731
    want = run(EngineConfig("resident", max_seq_len=32, batch=len(PROMPTS)))
    # S = E slots for L * E = 64 experts: every layer evicts the previous layers' experts
    got = run(EngineConfig("cached", num_slots=cfg.num_experts, max_seq_len=32, batch=len(PROMPTS)))
    logits = np.asarray(want.step_logits)
    assert logits.shape[:2] == (STEPS, len(PROMPTS)) and np.isfinite(logits).all() and logits.std() > 0
    assert got.generated_ids == want.generated_ids
    assert np.array_equal(np.asarray(got.step_logits), logits)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_entry_matches_the_arrays_it_makes(fmt):
    """Storage dtype, stored and scale shapes, and bytes per expert as declared, for banks whose
    widths are not multiples of the blocks (partial blocks at the edges)."""
    n, d, f = 3, 96, 80
    rng = np.random.default_rng(0)
    banks = ExpertBanks(jnp.asarray(rng.standard_normal((n, d, 2 * f)), jnp.float32),
                        jnp.asarray(rng.standard_normal((n, f, d)), jnp.float32))
    b = quant.quantize_banks(banks, fmt.expert_dtype)
    assert quant.bank_format(fmt.expert_dtype) == quant.bank_format(fmt.name) == b.fmt == fmt.name
    assert b.gate_up.dtype == b.down.dtype == fmt.storage
    assert b.gate_up.shape == (n,) + fmt.stored_shape(d, 2 * f) and b.down.shape == (n,) + fmt.stored_shape(f, d)
    if fmt.has_scales:
        sg, sd = b.scales
        assert sg.dtype == sd.dtype == fmt.scale_dtype
        assert sg.shape == (n,) + fmt.scale_shape(d, 2 * f, 2) and sd.shape == (n,) + fmt.scale_shape(f, d, 1)
    else:
        assert b.scales is None
    assert b.expert_bytes == fmt.expert_bytes(d, f, 2) == quant.expert_bytes(fmt.name, d, f, 2)
    assert b.expert_bytes < 3 * d * f * 4  # every format stores fewer bytes than float32
    gu, dn = quant.dequantize_banks_np(b)
    assert gu.shape == (n, d, 2 * f) and dn.shape == (n, f, d) and gu.dtype == np.float32


def test_registry_names_and_the_fused_kernel_list():
    names = [f.name for f in FORMATS]
    assert len(set(names)) == len(names) and len(set(IDS)) == len(IDS)
    assert quant.FORMATS == tuple(IDS) and set(quant.QUANT_FORMATS) == {f.name for f in FORMATS if f.has_scales}
    assert [f.name for f in FORMATS if not f.has_scales] == ["dense"]  # the one format without scales
    assert moe_decode.FORMATS == tuple(f.name for f in FORMATS if f.fused_decode)
    for f in FORMATS:
        assert formats.get(f.name) is formats.get(f.expert_dtype) is f


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fused_kernel_accepts_exactly_the_formats_that_claim_it(fmt):
    """Shapes every built-in kernel path takes (D = 256, F = 128); a format without kernel code must
    be refused, so its decode runs the jnp reference whatever FTJAX_KERNELS says."""
    d, f = 256, 128
    rng = np.random.default_rng(1)
    gu = jnp.asarray(rng.standard_normal((2, d, 2 * f)), jnp.bfloat16)
    dn = jnp.asarray(rng.standard_normal((2, f, d)), jnp.bfloat16)
    if fmt.has_scales:
        gu, dn = fmt.quantize(gu, 2)[0], fmt.quantize(dn, 1)[0]
    x = jnp.zeros((1, d), jnp.bfloat16)
    assert moe_decode.supported(x, gu, dn, fmt.name) == fmt.fused_decode


@pytest.mark.parametrize("bad", ["int3", "float8", "", "DENSE"])
def test_unknown_format_raises_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=f"unknown expert format {bad!r}") as e:
        formats.get(bad)
    assert all(n in str(e.value) for n in IDS)  # and lists the known ones
    for call in (lambda: quant.bank_format(bad), lambda: quant.expert_bytes(bad, 8, 8),
                 lambda: quant.quantize(bad, jnp.ones((8, 8)))):
        with pytest.raises(ValueError, match=repr(bad)):
            call()
    with pytest.raises(ValueError, match=repr(bad)):
        ExpertBanks(jnp.ones((1, 8, 8)), jnp.ones((1, 4, 8)), None, bad)
