"""The fusions and GEMMs XLA:GPU built for each program of an HLO dump, and the ops two programs of one name build
otherwise.

XLA:GPU decides per program which ops become a Triton fusion and with which tiles (``block_level_fusion_config``:
output tiles, warps; a reduction's tiles set its summation order), a Triton GEMM's config (``triton_gemm_config``,
with its split-K), a cuBLAS algorithm (``selected_algorithm``) and a cuDNN fusion's plan, the GEMMs by timing
candidates on the machine. Ops that land in other fusions may also round otherwise (XLA's default
``--xla_allow_excess_precision`` lets a fusion keep a 16-bit intermediate in float32). Where a resident and a cached
decode program differ in their logits although their kernels do the same arithmetic, this lists the candidates,
by the JAX op name XLA keeps in the metadata and the output shape: the ops both programs build as such a fusion or
GEMM but with another config or count (``ops``), and those only one of them builds so (``only_first``,
``only_second``: the other fused them elsewhere, or into a kind this does not list).

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_block" \\
      python experiments/bench_decode_speed.py ...
    python experiments/hlo_tiling.py /tmp/dump --out=tiling.json

With ``--across=jit_forward_step,jit_layer_program`` it also compares the first layer-scan program (a resident
prefill's, compiled first) with the pipelined driver's per-layer programs together, op by op without the programs'
and the scan's name prefixes (``experiments/gpu_stages.sh hybrid-fp32-driver-hlo``: which float32 op does the
pipelined driver build otherwise? docs/OVERLAP.md). It lists fusions and library calls with a config only: an op
XLA emits as a plain loop or reduction fusion is not among them.

Programs are read in module-number order (the order they were compiled: a dump of bench_decode_speed's resident
then cached rows holds their decode blocks in that order), and each pair of programs of one module name
(``jit_decode_block``) is compared. The JSON's ``meta`` is the machine this script ran on; run it where the dump was
made (``experiments/gpu_stages.sh`` does) for the dump's device and commit.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "write the JSON here, with the run's meta and flags (else print it, and the "
                           "listing to stderr)")
_PATTERN = flags.DEFINE_string("pattern", "*after_optimizations.txt", "the dump's files to read (a glob)")
_ACROSS = flags.DEFINE_list("across", [], "FIRST,SECOND module names (e.g. jit_forward_step,jit_layer_program): also "
                            "compare the first program of module FIRST with every program of module SECOND together, "
                            "by op names without their program's and the layer scan's prefixes and by the set of "
                            "configs each op is built with (a scan body holds several layers, a per-layer program "
                            "one): the layer scan against the pipelined driver's layer programs")

flags.register_validator("across", lambda v: len(v) in (0, 2), message="--across: give FIRST,SECOND module names")

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(*(\w+\[[^\]]*\](?:\{[^}]*\})?)")  # a tuple: its first
_FUSION_KIND = re.compile(r'"kind":"(__triton\w*|__cudnn\$\w+)"')
_CUSTOM_CALL = re.compile(r'custom_call_target="(__cublas\$[\w$]+|__cudnn\$[\w$]+)"')
_ALGORITHM = re.compile(r'"selected_algorithm":"?(-?\d+)"?')
_PLAN = re.compile(r'"plan_id":"?(-?\d+)"?')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_MODULE = re.compile(r"module_(\d+)\.(.+?)(?:\.sm_[\w.]+?_gpu|\.cpu)?[._]after_optimizations")


def _object_after(line: str, key: str) -> str:
    """The JSON object that follows ``"key":`` in ``line``, braces balanced; "" where the key is absent."""
    at = line.find(f'"{key}":{{')
    if at < 0:
        return ""
    start, depth = line.index("{", at), 0
    for i in range(start, len(line)):
        if line[i] == "{":
            depth += 1
        elif line[i] == "}":
            depth -= 1
            if depth == 0:
                return line[start:i + 1]
    return line[start:]


def tilings(text: str) -> list[dict]:
    """Every Triton or cuDNN fusion (with its tile or GEMM config, or its plan) and cuBLAS / cuDNN custom call (with
    its selected algorithm) of one HLO module's text, each as {name, shape, kind, config, op_name} (shape: the
    output's, a tuple's first; op_name: the JAX op XLA recorded, "" where none)."""
    out = []
    for line in text.splitlines():
        kind = config = None
        if m := _FUSION_KIND.search(line):
            kind = m.group(1)
            plan = _PLAN.search(line)
            config = (_object_after(line, "triton_gemm_config") or _object_after(line, "block_level_fusion_config")
                      or (f"plan {plan.group(1)}" if plan else ""))
        elif m := _CUSTOM_CALL.search(line):
            kind = m.group(1)
            a = _ALGORITHM.search(line)
            config = f"algorithm {a.group(1)}" if a else ""
        if kind is None or not (n := _NAME.match(line)):
            continue
        op = _OP_NAME.search(line)
        out.append({"name": n.group(1), "shape": n.group(2), "kind": kind, "config": config,
                    "op_name": op.group(1) if op else ""})
    return out


def differences(a: list[dict], b: list[dict]) -> dict:
    """How two lists of :func:`tilings` differ, by op (op name and output shape): ``ops``, those in both whose
    multisets of (kind, config) differ, each {op_name, shape, first, second} with each side's sorted
    [kind, config, count]; ``only_first`` / ``only_second``, those in one list only, each {op_name, shape, tilings}."""
    def by_op(rows):
        d = collections.defaultdict(collections.Counter)
        for r in rows:
            d[(r["op_name"], r["shape"])][(r["kind"], r["config"])] += 1
        return d

    def listed(counter):
        return sorted([kind, config, n] for (kind, config), n in counter.items())

    da, db = by_op(a), by_op(b)
    return {"ops": [{"op_name": op, "shape": shape, "first": listed(da[(op, shape)]), "second": listed(db[(op, shape)])}
                    for (op, shape) in sorted(da.keys() & db.keys()) if da[(op, shape)] != db[(op, shape)]],
            "only_first": [{"op_name": op, "shape": shape, "tilings": listed(da[(op, shape)])}
                           for (op, shape) in sorted(da.keys() - db.keys())],
            "only_second": [{"op_name": op, "shape": shape, "tilings": listed(db[(op, shape)])}
                            for (op, shape) in sorted(db.keys() - da.keys())]}


_PROGRAM_PREFIX = re.compile(r"^jit\([^)]*\)/(?:while/body/(?:eval_jaxpr/|closed_call/)?)?")


def layer_op(op_name: str) -> str:
    """An op name without its program's prefix and, where it sits in the layer scan's body, the scan's
    (``jit(forward_step)/while/body/eval_jaxpr/moe/add`` and ``jit(layer_program)/moe/add`` -> ``moe/add``), so that
    an op of the scan body and the same op of a per-layer program compare; loops inside a layer keep theirs."""
    return _PROGRAM_PREFIX.sub("", op_name)


def differences_across(first: list[dict], second: list[dict]) -> dict:
    """:func:`differences` of two lists of :func:`tilings` by :func:`layer_op` and output shape, with each op's
    configs compared as sets (a scan body builds an op once per layer of its block, a per-layer program once)."""
    def normalized(rows):
        seen = {(layer_op(r["op_name"]), r["shape"], r["kind"], r["config"]) for r in rows}
        return [{"op_name": op, "shape": shape, "kind": kind, "config": config} for op, shape, kind, config in seen]
    return differences(normalized(first), normalized(second))


def module_of(file_name: str) -> tuple[int, str]:
    """(module number, module name) of a dump's file name (``module_0042.jit_decode_block.sm_9.0a_gpu_after_
    optimizations.txt``, ``module_0042.jit_decode_block.after_optimizations.txt`` or XLA:CPU's
    ``module_0042.jit_decode_block.cpu_after_optimizations.txt`` -> (42, "jit_decode_block"));
    (-1, the file name) for a name of another form."""
    m = _MODULE.search(file_name)
    return (int(m.group(1)), m.group(2)) if m else (-1, file_name)


def main(argv):
    """Reads the dump folder ``argv[1]``, writes (``--out``) or prints the programs' lists and their differences."""
    if len(argv) != 2:
        raise app.UsageError("give one HLO dump folder")
    folder = pathlib.Path(argv[1])
    files = sorted(folder.glob(_PATTERN.value), key=lambda f: module_of(f.name))
    if not files:
        sys.exit(f"hlo_tiling: no {_PATTERN.value} under {folder}")
    programs = [{"file": f.name, "module": module_of(f.name)[1], "tilings": tilings(f.read_text())} for f in files]
    pairs = []
    for i, a in enumerate(programs):
        for b in programs[i + 1:]:
            if a["module"] == b["module"]:
                pairs.append({"first": a["file"], "second": b["file"], **differences(a["tilings"], b["tilings"])})
    if _ACROSS.value:
        name_a, name_b = _ACROSS.value
        first = next((p for p in programs if p["module"] == name_a), None)
        second = [p for p in programs if p["module"] == name_b]
        if first is None or not second:
            sys.exit(f"hlo_tiling: --across: no program of module {name_a if first is None else name_b} under {folder}")
        pairs.append({"first": first["file"], "second": [p["file"] for p in second],
                      **differences_across(first["tilings"], [t for p in second for t in p["tilings"]])})
    result = {"dump": folder.name,
              "programs": [{"file": p["file"], "module": p["module"], "count": len(p["tilings"]),
                            "tilings": p["tilings"]} for p in programs],
              "differences": pairs}
    if _OUT.value:  # written before anything is printed: a closed pipe (| head) must not lose it
        out = pathlib.Path(_OUT.value)
        common.write_json(str(out.parent), out.name, result)
        listing = sys.stdout
    else:
        print(json.dumps(result, indent=1))
        listing = sys.stderr  # stdout holds the JSON alone
    alone = [p["file"] for p in programs if sum(q["module"] == p["module"] for q in programs) == 1]
    if alone:
        print(f"hlo_tiling: compared with no other program (no other of its module name): {alone}", file=sys.stderr)
    for d in pairs:
        second = d["second"] if isinstance(d["second"], str) else f"{len(d['second'])} programs together"
        print(f"{d['first']} vs {second}: {len(d['ops'])} ops built otherwise, {len(d['only_first'])} only in "
              f"the first, {len(d['only_second'])} only in the second", file=listing)
        for op in d["ops"]:
            print(f"  {op['op_name']} {op['shape']}: {op['first']} vs {op['second']}", file=listing)
        for side in ("only_first", "only_second"):
            for op in d[side]:
                print(f"  {side}: {op['op_name']} {op['shape']}: {op['tilings']}", file=listing)

if __name__ == "__main__":
    common.run(main)
