"""The tiling XLA:GPU chose for each fusion and GEMM of the programs of an HLO dump, and the ops for which a
pair of programs chose differently.

XLA:GPU picks a Triton fusion's tiles (``block_level_fusion_config``: output tiles, warps; a reduction's tiles set
its summation order), a Triton GEMM's config (``triton_gemm_config``, with its split-K) and a cuBLAS algorithm
(``selected_algorithm``) per program, the GEMMs by timing candidates on the machine. Two programs that compute the
same op may so sum it in another order. Where a resident and a cached decode program differ in their logits although
their kernels do the same arithmetic, this lists the candidates: the ops (by the JAX op name XLA keeps in the
metadata, with the output shape) whose tiling differs between the programs.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=decode_block" \\
      python experiments/bench_decode_speed.py ...
    python experiments/hlo_tiling.py /tmp/dump --out=tiling.json

Every pair of programs is compared (a dump of bench_decode_speed's resident then cached rows holds their decode
blocks in that order, by module number).
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

_OUT = flags.DEFINE_string("out", None, "write the JSON here, with the run's meta and flags (else print it)")
_PATTERN = flags.DEFINE_string("pattern", "*after_optimizations.txt", "the dump's files to read (a glob)")

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(\w+\[[^\]]*\](?:\{[^}]*\})?)")  # a tuple: its first
_TRITON = re.compile(r'"kind":"(__triton\w*)"')
_CUBLAS = re.compile(r'custom_call_target="(__cublas\$[\w$]+|__cudnn\$[\w$]+)"')
_ALGORITHM = re.compile(r'"selected_algorithm":"?(-?\d+)"?')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


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
    """Every Triton fusion (``kind`` ``__triton...``, with its tile or GEMM config) and cuBLAS / cuDNN custom call
    (with its selected algorithm) of one HLO module's text, each as {name, shape, kind, config, op_name}
    (op_name: the JAX op XLA recorded, "" where none)."""
    out = []
    for line in text.splitlines():
        kind = config = None
        if m := _TRITON.search(line):
            kind = m.group(1)
            config = _object_after(line, "triton_gemm_config") or _object_after(line, "block_level_fusion_config")
        elif m := _CUBLAS.search(line):
            kind = m.group(1)
            a = _ALGORITHM.search(line)
            config = f"algorithm {a.group(1)}" if a else ""
        if kind is None or not (n := _NAME.match(line)):
            continue
        op = _OP_NAME.search(line)
        out.append({"name": n.group(1), "shape": n.group(2), "kind": kind, "config": config,
                    "op_name": op.group(1) if op else ""})
    return out


def differences(a: list[dict], b: list[dict]) -> list[dict]:
    """The ops (op name and output shape) found in both lists of :func:`tilings` whose multisets of (kind, config)
    differ: {op_name, shape, first, second} with each side's sorted [kind, config] pairs."""
    def by_op(rows):
        d = collections.defaultdict(collections.Counter)
        for r in rows:
            d[(r["op_name"], r["shape"])][(r["kind"], r["config"])] += 1
        return d

    da, db = by_op(a), by_op(b)
    return [{"op_name": op, "shape": shape, "first": sorted(map(list, da[(op, shape)])),
             "second": sorted(map(list, db[(op, shape)]))}
            for (op, shape) in sorted(da.keys() & db.keys()) if da[(op, shape)] != db[(op, shape)]]


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("give one HLO dump folder")
    folder = pathlib.Path(argv[1])
    files = sorted(folder.glob(_PATTERN.value))
    if not files:
        sys.exit(f"hlo_tiling: no {_PATTERN.value} under {folder}")
    programs = []
    for f in files:
        text = f.read_text()
        programs.append({"file": f.name, "tilings": tilings(text)})
    result = {"programs": [{"file": p["file"], "count": len(p["tilings"]), "tilings": p["tilings"]} for p in programs]}
    result["differences"] = [{"first": a["file"], "second": b["file"], "ops": differences(a["tilings"], b["tilings"])}
                             for i, a in enumerate(programs) for b in programs[i + 1:]]
    for d in result["differences"]:
        print(f"{d['first']} vs {d['second']}: {len(d['ops'])} ops tiled otherwise")
        for op in d["ops"]:
            print(f"  {op['op_name']} {op['shape']}: {op['first']} vs {op['second']}")
    if _OUT.value:
        out = pathlib.Path(_OUT.value)
        common.write_json(str(out.parent), out.name, result)
    elif len(programs) == 1:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    common.run(main)
