"""What a compiled step contains, read from its optimized HLO text (`compiled.as_text()`).

A kernel is an instruction that launches device work: a `fusion` (one generated kernel), a
`custom-call` (cuBLAS/cuBLASLt GEMM, a Pallas/Triton kernel, ...) or any other op left
standalone (a lone `copy`, `sort`, ...). Bookkeeping ops (parameter, tuple, bitcast, ...)
launch nothing. Control flow is followed: the entry computation, `call`s, the bodies of
`while` loops (counted trip-count times when XLA knows it) and `conditional` branches
(counted apart: which branch runs is data dependent). Kernels per decoder layer = the kernels
of the while body whose trip count is the layer count (the decoder's lax.scan).

XLA GPU command buffers (CUDA graphs) show up as `call`s to computations named
`command_buffer*`: the kernels inside one are launched as one graph.
"""
from __future__ import annotations

import collections
import dataclasses
import re

FREE_OPS = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
    "domain", "async-done", "copy-done", "send-done", "recv-done"))
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_KIND = re.compile(r"kind=(k\w+)")
# The decoder's lax.scan: op names "jit(<step>)/while/body/..." (nested loops sit deeper).
# Kernels of one decoder layer: from the scan body, or (layers unrolled in Python) from the
# model's "decoder_layer" name scope.
_SCAN_OP = re.compile(r'op_name="[^/"]+/(?:while/body|decoder_layer)/')


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    line: str

    def called(self, key: str) -> list[str]:
        m = re.search(key + r"=\{?(%[\w.\-]+(?:, %[\w.\-]+)*)\}?", self.line)
        return [c.strip()[1:] for c in m.group(1).split(",")] if m else []


def _opcode(rest: str) -> str:
    """`TYPE opcode(args)...` -> opcode; TYPE may be a parenthesized tuple with spaces."""
    i = 0
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
    rest = rest[i:].split(" ", 1)[1] if " " in rest[i:] else ""
    return rest.split("(", 1)[0].strip()


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """HLO module text -> ({computation: instructions}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            comps[current].append(Instr(m.group(1), _opcode(line[m.end():]), line))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


@dataclasses.dataclass
class Count:
    """Kernels reached from one computation, loops multiplied by their trip counts."""
    kernels: int = 0
    conditional: int = 0   # kernels inside conditional branches (the largest branch each)
    command_buffers: int = 0
    in_command_buffers: int = 0


def _count(comps, name: str, loops: list, depth: int = 0) -> Count:
    total = Count()
    for ins in comps.get(name, ()):
        if ins.opcode == "while":
            body = ins.called("body")[0]
            trip = _TRIP.search(ins.line)
            n = int(trip.group(1)) if trip else 1
            inner = _count(comps, body, loops, depth + 1)
            loops.append((body, n, inner.kernels))
            _add(total, inner, n)
        elif ins.opcode == "conditional":
            branches = [_count(comps, b, loops, depth + 1) for b in ins.called(
                "branch_computations") + ins.called("true_computation") +
                ins.called("false_computation")]
            total.conditional += max((b.kernels + b.conditional for b in branches), default=0)
        elif ins.opcode in ("call", "async-start"):
            target = (ins.called("to_apply") or ins.called("calls"))[0]
            inner = _count(comps, target, loops, depth + 1)
            if "command_buffer" in target:
                total.command_buffers += 1
                total.in_command_buffers += inner.kernels
            _add(total, inner, 1)
        elif ins.opcode not in FREE_OPS:
            total.kernels += 1
    return total


def _add(total: Count, inner: Count, n: int) -> None:
    total.kernels += n * inner.kernels
    total.conditional += n * inner.conditional
    total.command_buffers += n * inner.command_buffers
    total.in_command_buffers += n * inner.in_command_buffers


def _describe(comps, name: str) -> dict:
    """Kernel breakdown of one computation: by kind, custom-call targets, fused op sets."""
    kinds, targets, fused = collections.Counter(), collections.Counter(), []
    for ins in _flatten_calls(comps, name):
        if ins.opcode == "fusion":
            kind = _KIND.search(ins.line)
            kinds["fusion:" + (kind.group(1) if kind else "?")] += 1
            ops = sorted({i.opcode for i in comps.get(ins.called("calls")[0], ())} - FREE_OPS)
            fused.append({"name": ins.name, "ops": ops})
        elif ins.opcode == "custom-call":
            target = _TARGET.search(ins.line)
            targets[target.group(1) if target else "?"] += 1
            kinds["custom-call"] += 1
        elif ins.opcode not in FREE_OPS:
            kinds[ins.opcode] += 1
    return {"by_kind": dict(kinds), "custom_calls": dict(targets), "fusions": fused}


def _flatten_calls(comps, name: str):
    """Instructions of `name`, with those of the computations it `call`s (command buffers)
    inlined."""
    for ins in comps.get(name, ()):
        if ins.opcode == "call":
            yield from _flatten_calls(comps, ins.called("to_apply")[0])
        else:
            yield ins


def analyze(text: str, num_layers: int | None = None) -> dict:
    """Kernels per step and per decoder layer of a compiled step's HLO text."""
    comps, entry = parse(text)
    loops: list[tuple[str, int, int]] = []
    step = _count(comps, entry, loops)
    layer = [lp for lp in loops if lp[1] == num_layers]
    body = max(layer, key=lambda lp: lp[2])[0] if layer else None
    per_layer, source = (_count(comps, body, []).kernels, "while_body") if body else \
        _unrolled_per_layer(comps, entry, num_layers)
    out = {"kernels_per_step": step.kernels,
           "conditional_kernels": step.conditional,
           "kernels_per_layer": per_layer,
           "kernels_per_layer_source": source,
           "command_buffers_per_step": step.command_buffers,
           "kernels_in_command_buffers": step.in_command_buffers,
           "command_buffer_coverage": round(step.in_command_buffers / step.kernels, 3)
           if step.kernels else 0.0,
           "entry": _describe(comps, entry)}
    out["layer"] = _describe(comps, body) if body else None
    out["custom_call_targets"] = _all_targets(comps)
    return out


def _unrolled_per_layer(comps, entry: str, num_layers: int | None):
    """Layers unrolled (by XLA, or in Python: EngineConfig.unroll_layers): count the kernels
    whose op names come from the scan body or the decoder_layer scope."""
    if not num_layers:
        return None, None
    n = sum(1 for ins in _flatten_calls(comps, entry)
            if ins.opcode not in FREE_OPS and _SCAN_OP.search(ins.line))
    return (round(n / num_layers), "unrolled_metadata") if n else (None, None)


def _all_targets(comps) -> dict:
    targets = collections.Counter()
    for instrs in comps.values():
        for ins in instrs:
            if ins.opcode == "custom-call":
                m = _TARGET.search(ins.line)
                targets[m.group(1) if m else "?"] += 1
    return dict(targets)


def decode_step_analysis(model: str, engine, batch: int = 1) -> dict:
    """`analyze` of the decode step (bucket B = T = batch) of a standard shape under `engine`
    (an EngineConfig), compiled from abstract weights: nothing is allocated but a small KV
    pool, so even a 32B shape costs only its compile."""
    import jax

    from jaxinfer.buckets import Bucket
    from jaxinfer.config import standard_config
    from checkpoints.model_state import abstract_model
    from jaxinfer.runner import ModelRunner
    from jaxinfer.step_input import dummy_input

    from jaxinfer.loading import resolve_unroll

    cfg = standard_config(model)
    graphdef, params = abstract_model(cfg, jax.numpy.dtype(engine.dtype),
                                      fp8=engine.weights == "fp8",
                                      unroll_layers=resolve_unroll(engine.unroll_layers))
    runner = ModelRunner(cfg, engine.replace(num_pages=2), graphdef, params)
    inp = dummy_input(Bucket(batch, batch, engine.pages_per_seq, True))
    lowered = runner.lower(inp)
    return analyze(lowered.compile().as_text(), cfg.num_layers)
