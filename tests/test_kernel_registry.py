"""The kernel registry and the kernel config (``ftjax.kernels.registry``): what ``KernelConfig`` refuses
(each error names its field), what every registered kernel declares, that the config is part of every
program's key, and ``Engine.kernel_notes()`` for a kernel asked for by name that applied to no program.
Tiny shapes only (``preset("tiny")``)."""

from __future__ import annotations

import dataclasses
import importlib
import re

import numpy as np
import pytest

from ftjax.kernels import registry
from ftjax.kernels.registry import KernelConfig


# ------------------------------------------------------------------ KernelConfig validation
@pytest.mark.parametrize("kw,field,match", [
    (dict(use=("nope",)), "use", "unknown kernel 'nope'"),
    (dict(use="moe_decode,nope"), "use", "unknown kernel 'nope'"),
    (dict(use="everything"), "use", "unknown kernel 'everything'"),
    (dict(use=5), "use", r"expected one of auto, xla, interpret, kernel names or auto\+name"),
    (dict(tiles={"nope": (1, 2, 3, 4)}), "tiles", "unknown kernel 'nope'"),
])
def test_unknown_kernel_names_are_refused_naming_the_field(kw, field, match):
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: .*{match}"):
        KernelConfig(**kw)


def test_a_named_kernel_needs_the_kernels_it_reads():
    """Each kernel with ``needs``, named alone, is refused (the message names what is missing); named with
    what it needs (and what those need) it is accepted."""
    with_needs = {n: k for n, k in registry.kernels().items() if k.needs}
    assert {"route_decode", "rope_cache", "merge_dense_decode"} <= set(with_needs)
    for name, kernel in with_needs.items():
        with pytest.raises(ValueError, match=rf"KernelConfig\.use: kernel '{name}' needs {kernel.needs[0]}"):
            KernelConfig(use=(name,))
        closure, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in closure:
                closure.add(n)
                todo += registry.get(n).needs
        assert KernelConfig(use=tuple(closure)).named == tuple(sorted(closure))
    with pytest.raises(ValueError, match="KernelConfig.use: kernel 'route_decode' needs norm_dense_decode"):
        KernelConfig(use="dense_decode,route_decode")
    with pytest.raises(ValueError, match="KernelConfig.use: kernel 'rope_cache' needs decode_attention"):
        KernelConfig(use="norm_dense_decode,rope_cache")


@pytest.mark.parametrize("tiles,match", [
    ({"dense_decode": (32, 64)}, "four integers"),
    ({"dense_decode": (48, 64, 0, 0)}, "powers of two"),
    ({"dense_decode": (32, 64, 3, 0)}, "power of two or 0"),
    ({"dense_decode": (32, 64, 0, -1)}, "k_split >= 0"),
    ({"moe_decode": (64, 64, 0, 4, 128)}, r"block_d,block_f,num_warps,d_split\[,down_cols,down_rows\]"),
    ({"moe_decode": (0, 64, 0, 0)}, "block_d and block_f must be >= 1"),
    ({"dense_decode": "32,64,0,0"}, "expected \\(kernel name, integers\\) pairs"),
    ({"dense_decode": (32.0, 64, 0, 0)}, "expected \\(kernel name, integers\\) pairs"),
    ({"dense_decode": 32}, "expected \\(kernel name, integers\\) pairs"),
    ((("dense_decode",),), "expected \\(kernel name, integers\\) pairs"),
    ({"slot_lookup": (1, 2)}, "kernel 'slot_lookup' has no tiles"),
])
def test_malformed_tiles_are_refused_naming_the_field(tiles, match):
    with pytest.raises(ValueError, match=rf"KernelConfig\.tiles: .*{match}"):
        KernelConfig(tiles=tiles)


@pytest.mark.parametrize("field", ["grouped_matmul", "flash_prefill", "slot_order", "decode_gemm", "decode_graphs"])
def test_bad_choices_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=rf"KernelConfig\.{field}: unknown value 'bogus'; expected one of "):
        KernelConfig(**{field: "bogus"})


@pytest.mark.parametrize("rows", [-1, "four", 2.0, True])
def test_bad_min_dot_rows_is_refused_naming_the_field(rows):
    with pytest.raises(ValueError, match=r"KernelConfig\.min_dot_rows: expected None or an integer >= 0"):
        KernelConfig(min_dot_rows=rows)


@pytest.mark.parametrize("group", [0, -1, "eight", 2.0, True])
def test_bad_fetch_group_is_refused_naming_the_field(group):
    with pytest.raises(ValueError, match=r"KernelConfig\.fetch_group: expected None or an integer >= 1"):
        KernelConfig(fetch_group=group)


def test_fetch_group_default_is_per_backend():
    from ftjax.kernels.registry import FETCH_GROUP
    assert KernelConfig().miss_group() == FETCH_GROUP == 1 and KernelConfig(fetch_group=3).miss_group() == 3


@pytest.mark.parametrize("blocks", [0, 65536, "four", 4.0, True])
def test_bad_prefetch_blocks_is_refused_naming_the_field(blocks):
    with pytest.raises(ValueError, match=r"KernelConfig\.prefetch_blocks: expected None or an integer 1 to 65535"):
        KernelConfig(prefetch_blocks=blocks)


def test_prefetch_blocks_default_and_override_and_key():
    """Unset: the measured default; set: its value; and a config that sets it is another program key."""
    from ftjax.kernels.registry import PREFETCH_BLOCKS
    assert KernelConfig().prefetch_blocks_per_miss() == PREFETCH_BLOCKS == 4
    assert KernelConfig(prefetch_blocks=16).prefetch_blocks_per_miss() == 16
    assert KernelConfig(prefetch_blocks=16) != KernelConfig() and KernelConfig(prefetch_blocks=4) != KernelConfig()


def test_equal_choices_make_equal_configs():
    """A comma-separated string and a tuple in another order, a dict of tiles and its pairs: one config
    (equal and of one hash, so one program key)."""
    a = KernelConfig(use="moe_decode, flash_prefill", tiles={"moe_decode": [64, 64, 0, 2]})
    b = KernelConfig(use=("flash_prefill", "moe_decode", "moe_decode"), tiles=(("moe_decode", (64, 64, 0, 2)),))
    assert a == b and hash(a) == hash(b)
    assert a.named == ("flash_prefill", "moe_decode") and a.tiles == (("moe_decode", (64, 64, 0, 2)),)
    assert KernelConfig().named == KernelConfig(use="interpret").named == ()
    assert KernelConfig(use=["moe_decode", "flash_prefill"]).use == a.use  # a list, as as_dict() writes, reads back
    assert a.as_dict()["use"] == ["flash_prefill", "moe_decode"]


def test_auto_with_kernels_added_and_taken_away():
    """``use="auto+a-b"``: auto's choice for every other kernel, ``a`` as if named (interpreted off a GPU) and ``b``
    never; the terms in any order make one config; bad terms and needs are refused naming the field."""
    a = KernelConfig(use="auto-grouped_swiglu_triton+gated_deltanet_decode")
    b = KernelConfig(use="auto+gated_deltanet_decode-grouped_swiglu_triton")
    assert a == b and hash(a) == hash(b) and a.use == "auto+gated_deltanet_decode-grouped_swiglu_triton"
    assert a.named == ("gated_deltanet_decode",) and a.as_dict()["use"] == a.use
    auto_kernel = next(n for n, k in registry.kernels().items() if k.auto and n != "grouped_swiglu_triton")
    with registry.using(a):
        assert registry.mode("gated_deltanet_decode") == "interpret"  # the CPU: a named kernel is interpreted
        assert registry.mode("grouped_swiglu_triton") == "xla"
        assert registry.mode(auto_kernel) == "xla"  # auto's choice on the CPU
        assert registry.mode("gated_deltanet_decode", supported=False) == "xla"
        with registry.lowering_for("gpu"):
            assert registry.mode("gated_deltanet_decode") == "gpu"
            assert registry.mode(auto_kernel) == "gpu" and registry.mode(auto_kernel, auto=False) == "xla"
            assert registry.mode("grouped_swiglu_triton") == "xla"
    for bad, match in [("auto+", "expected auto followed by"), ("auto++moe_decode", "expected auto followed by"),
                       ("auto+nope", "unknown kernel 'nope'"),
                       ("auto+moe_decode-moe_decode", "moe_decode both added and removed"),
                       ("auto+rope_cache-decode_attention", "kernel 'rope_cache' needs decode_attention")]:
        with pytest.raises(ValueError, match=rf"KernelConfig\.use: .*{match}"):
            KernelConfig(use=bad)


# ------------------------------------------------------------------ the registered kernels
def _resolve(dotted: str):
    """The object a dotted name ``pkg.module.attr`` names (the longest importable module prefix, then
    attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_registered_kernel_names_its_reference_and_where_it_applies():
    """Each entry names the plain-JAX function it must match (its first word is a dotted name that exists
    and is callable), says where it applies, needs registered kernels only, and has a tile parser only
    where tiles are taken; the names are the sorted keys."""
    kernels = registry.kernels()
    assert registry.names() == tuple(sorted(kernels))
    assert {"decode_attention", "dense_decode", "flash_prefill", "moe_decode", "norm_dense_decode",
            "rope_cache", "route_decode", "slot_lookup", "merge_dense_decode"} <= set(kernels)
    for name, k in kernels.items():
        assert k.name == name and registry.get(name) is k
        assert isinstance(k.reference, str) and k.reference.strip(), name
        assert callable(_resolve(k.reference.split()[0])), (name, k.reference)
        assert isinstance(k.applies, str) and len(k.applies.split()) >= 3, (name, k.applies)
        assert all(n in kernels and n != name for n in k.needs), (name, k.needs)
        assert isinstance(k.auto, bool)
    assert {n for n, k in kernels.items() if k.tiles is not None} >= {"dense_decode", "moe_decode"}
    with pytest.raises(ValueError, match="unknown kernel 'nope'; expected one of "):
        registry.get("nope")


def test_the_package_docstring_names_every_kernel_and_those_auto_leaves_out():
    """``ftjax.kernels``' docstring, the kernels' map, names every registered kernel, and its "by name only" line
    lists exactly the kernels whose entry ``auto`` does not pick (it went stale once: a kernel made auto kept
    "named only" there)."""
    import ftjax.kernels as pkg
    doc = pkg.__doc__
    missing = [n for n in registry.names() if f"``{n}``" not in doc]
    assert not missing, f"ftjax/kernels/__init__.py does not name {missing}"
    line = doc.split("by name only:", 1)[1].split(".", 1)[0]
    listed = set(re.findall(r"``(\w+)``", line))
    assert listed == {n for n, k in registry.kernels().items() if not k.auto}, line


def test_registering_another_kernel_under_a_taken_name_is_refused():
    k = registry.get("slot_lookup")
    assert registry.register(k) is k  # the same entry again (a module imported twice): fine
    with pytest.raises(ValueError, match="kernel 'slot_lookup' is registered twice"):
        registry.register(dataclasses.replace(k, applies="somewhere else"))
    assert registry.get("slot_lookup") is k


# ------------------------------------------------------------------ engines: program keys and kernel notes
@pytest.fixture(scope="module")
def tiny():
    from ftjax.checkpoint import random_model
    from ftjax.config import preset
    return random_model(preset("tiny"), "float32")


def _engine(model, kernels: KernelConfig, mode="resident", slots=None):
    from ftjax import Engine
    from ftjax.config import EngineConfig
    return Engine(model, EngineConfig(mode, num_slots=slots, max_seq_len=32, prefill_chunk=16, kernels=kernels))


def _decode_only(eng):
    """One decode step of a batch row holding no request: the engine's only program is the decode step."""
    eng.open_rows(1)
    out = eng.advance(np.zeros((1, 1), np.int32))
    assert out.kind == "decode"
    return np.asarray(out.logits)


def test_a_changed_kernel_config_compiles_new_programs(tiny):
    """Two engines that differ only in ``KernelConfig.use`` ("xla" and "auto": on the CPU the same jnp code)
    get programs of their own, with no cache clearing in between: the config is in every step's key. A
    third engine with the first one's config compiles nothing new."""
    from ftjax.runtime import programs

    prompt = [list(range(1, 10))]
    xla = _engine(tiny, KernelConfig(use="xla"))
    a = xla.generate(prompt, 2, keep_logits=True)
    auto = _engine(tiny, KernelConfig(use="auto"))
    b = auto.generate(prompt, 2, keep_logits=True)
    steps_a = {k for k in xla.programs.keys if k[0] == "forward_step"}
    steps_b = {k for k in auto.programs.keys if k[0] == "forward_step"}
    assert len(steps_a) == len(steps_b) == 2  # the prefill call and the decode step
    assert not steps_a & steps_b
    assert {dict(k[1])["opts"].kernels for k in steps_a} == {KernelConfig(use="xla")}
    assert {dict(k[1])["opts"].kernels for k in steps_b} == {KernelConfig(use="auto")}
    # the options differ in their kernel config only
    strip = {dataclasses.replace(dict(k[1])["opts"], kernels=KernelConfig()) for k in steps_a}
    assert strip == {dataclasses.replace(dict(k[1])["opts"], kernels=KernelConfig()) for k in steps_b}
    assert a.generated_ids == b.generated_ids
    np.testing.assert_array_equal(a.step_logits, b.step_logits)
    before = set(programs._COMPILED)
    again = _engine(tiny, KernelConfig(use="xla"))
    again.generate(prompt, 2)
    assert again.programs.keys <= before and steps_a <= again.programs.keys


def test_kernel_notes_name_a_kernel_that_applied_to_no_program(tiny):
    """``Engine.kernel_notes()``: flash_prefill asked for by name on a decode-only run applied to no program,
    and the note says so (with where it applies); decode_attention asked for on the same run applied (no
    note, and ``describe()`` lists it); under ``auto`` there is never a note."""
    flash = _engine(tiny, KernelConfig(use=("flash_prefill",)))
    _decode_only(flash)
    notes = flash.kernel_notes()
    assert len(notes) == 1 and "'flash_prefill'" in notes[0] and "applied to no program" in notes[0]
    assert registry.get("flash_prefill").applies in notes[0]
    assert "flash_prefill" not in flash.describe()["kernels_applied"]

    attn = _engine(tiny, KernelConfig(use=("decode_attention",)))
    _decode_only(attn)
    assert attn.kernel_notes() == []
    assert "decode_attention" in attn.describe()["kernels_applied"]

    auto = _engine(tiny, KernelConfig())
    auto.generate([list(range(1, 10))], 2)
    assert auto.kernel_notes() == []


def test_kernel_notes_name_a_kernel_whose_operands_it_does_not_take():
    """slot_lookup asked for by name in the cached mode of a model with 12 experts (the kernel takes a power
    of two): every lookup keeps the jnp path, and the engine says so; with 16 experts it applies."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    odd = random_model(dataclasses.replace(preset("tiny"), num_experts=12, num_layers=2), "float32")
    eng = _engine(odd, KernelConfig(use=("slot_lookup",)), "cached", 24)
    _decode_only(eng)
    notes = eng.kernel_notes()
    assert len(notes) == 1 and "'slot_lookup'" in notes[0] and "applied to no program" in notes[0]
    even = random_model(dataclasses.replace(preset("tiny"), num_layers=2), "float32")
    eng = _engine(even, KernelConfig(use=("slot_lookup",)), "cached", 32)
    _decode_only(eng)
    assert eng.kernel_notes() == [] and "slot_lookup" in eng.describe()["kernels_applied"]


def test_kernel_notes_after_a_prefill_only_run_and_for_projections_the_kernel_does_not_take():
    """dense_decode asked for by name: on a run of prefill calls only (the request API, no decode step) it
    applied to no program, and on the decode step of a model of hidden size 96 (not a multiple of its
    64-row tile) neither: the engine says so in both cases. (The look-ahead of ``model.stacked_weights``
    used to count as the kernel applying.) On the tiny model's decode step it applies."""
    from ftjax.checkpoint import random_model
    from ftjax.config import preset

    kernels = KernelConfig(use=("dense_decode",))
    one = random_model(dataclasses.replace(preset("tiny"), num_layers=1), "float32")
    eng = _engine(one, kernels)
    eng.open_rows(1)
    eng.admit(list(range(1, 10)))
    assert eng.advance().kind == "prefill" and not eng.prefilling()
    notes = eng.kernel_notes()
    assert len(notes) == 1 and "'dense_decode'" in notes[0] and "applied to no program" in notes[0]
    assert eng.describe()["kernels_applied"] == []

    wide = random_model(dataclasses.replace(preset("tiny"), num_layers=1, hidden_size=96), "float32")
    eng = _engine(wide, kernels)
    _decode_only(eng)
    notes = eng.kernel_notes()
    assert len(notes) == 1 and "'dense_decode'" in notes[0] and "applied to no program" in notes[0]

    eng = _engine(one, kernels)
    _decode_only(eng)
    assert eng.kernel_notes() == [] and eng.describe()["kernels_applied"] == ["dense_decode"]
