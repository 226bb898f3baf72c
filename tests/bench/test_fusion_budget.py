"""The fusion budget (bench/fusion_budget.json): the decode step's kernels per decoder layer,
counted from the compiled HLO, must not exceed the recorded number. Plus the counter itself,
on hand-written HLO and on the tiny model's compiled step."""
import json
from pathlib import Path

import jax
import pytest

from bench import hlo
from jaxinfer.config import EngineConfig, standard_config

BUDGET = json.loads((Path(__file__).resolve().parents[2] / "bench" /
                     "fusion_budget.json").read_text())["budgets"]

SYNTHETIC = """HloModule m

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p)
  ROOT %m = f32[4]{0} multiply(%e, %e)
}

%command_buffer.1 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %f1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_a
  ROOT %f2 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_a
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %g = f32[4]{0} custom-call(%x), custom_call_target="__cublas$gemm"
  %c = f32[4]{0} call(%g), to_apply=%command_buffer.1
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%branch_small (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%x)
}

%branch_big (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %a = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  ROOT %b = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_a
}

ENTRY %main (a: f32[4], s: s32[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %s = s32[] parameter(1)
  %t0 = (s32[], f32[4]{0}) tuple(%s, %a)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4]{0} get-tuple-element(%w), index=1
  %z = f32[4]{0} copy(%y)
  ROOT %q = f32[4]{0} conditional(%s, %z, %z), branch_computations={%branch_small, %branch_big}
}
"""


def test_counter_on_handwritten_hlo():
    a = hlo.analyze(SYNTHETIC, num_layers=3)
    assert a["kernels_per_layer"] == 3                 # gemm + two fusions in the graph
    assert a["kernels_per_step"] == 3 * 3 + 1          # + the lone copy
    assert a["conditional_kernels"] == 2               # the larger branch
    assert a["command_buffers_per_step"] == 3
    assert a["kernels_in_command_buffers"] == 6
    assert a["layer"]["custom_calls"] == {"__cublas$gemm": 1}
    assert a["layer"]["fusions"][0]["ops"] == ["exponential", "multiply"]
    assert hlo.analyze(SYNTHETIC, num_layers=4)["kernels_per_layer"] is None


def _budgets(platform):
    return [b for b in BUDGET if b["platform"] == platform]


def _check(entry):
    engine = EngineConfig(dtype=entry["dtype"], weights=entry["weights"])
    a = hlo.decode_step_analysis(entry["model"], engine, batch=1)
    layers = standard_config(entry["model"]).num_layers
    assert a["kernels_per_layer"] is not None, "no while loop of the layer count: scan unrolled?"
    assert a["kernels_per_step"] >= layers * a["kernels_per_layer"]
    assert entry["kernels_per_layer"] is not None, (
        f"no budget recorded for {entry}: measured {a['kernels_per_layer']} kernels per layer; "
        f"write it into bench/fusion_budget.json")
    assert a["kernels_per_layer"] <= entry["kernels_per_layer"], (
        f"{entry['model']} decode step: {a['kernels_per_layer']} kernels per decoder layer, "
        f"budget {entry['kernels_per_layer']}: something un-fused (fused ops now: "
        f"{[f['ops'] for f in a['layer']['fusions']]})")


@pytest.mark.parametrize("entry", _budgets("cpu"), ids=lambda e: e["model"])
def test_cpu_budget(entry):
    _check(entry)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", _budgets("gpu"), ids=lambda e: f"{e['model']}-{e['weights']}")
def test_gpu_budget(entry):
    assert jax.default_backend() == "gpu"
    _check(entry)


def test_counter_when_xla_unrolled_the_layer_loop():
    body = "\n".join(f'  %f{i} = f32[4]{{0}} fusion(%a), kind=kLoop, calls=%fused_a, '
                     f'metadata={{op_name="jit(_step)/while/body/closed_call/mul"}}'
                     for i in range(6))
    text = SYNTHETIC.split("ENTRY")[0] + (
        "ENTRY %main (a: f32[4]) -> f32[4] {\n  %a = f32[4]{0} parameter(0)\n" + body +
        '\n  ROOT %g = f32[4]{0} fusion(%f5), kind=kLoop, calls=%fused_a, '
        'metadata={op_name="jit(_step)/argmax"}\n}\n')
    a = hlo.analyze(text, num_layers=3)
    assert (a["kernels_per_layer"], a["kernels_per_layer_source"]) == (2, "unrolled_metadata")
    assert a["kernels_per_step"] == 7
