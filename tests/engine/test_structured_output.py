"""Structured output (jaxinfer/structured_output.py) on the real model: sampled generations
held to JSON schemas parse and validate (jsonschema), regex and choice outputs match, bad
specs are refused before queueing with the field named, a warmed engine compiles nothing
for them, and async scheduling gives the same tokens as synchronous steps."""
import json
import re

import jsonschema
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.config import EngineConfig
from jaxinfer.errors import InvalidRequestError, InvalidTypeError
from jaxinfer.runner import CompileCounter

SCHEMAS = [
    {"type": "object",        # nested objects, an integer range
     "properties": {"name": {"type": "string", "maxLength": 20},
                    "address": {"type": "object",
                                "properties": {"city": {"type": "string", "maxLength": 20},
                                               "zip": {"type": "integer", "minimum": 0,
                                                       "maximum": 99999}},
                                "required": ["city", "zip"]}},
     "required": ["name", "address"]},
    {"type": "object",        # enums
     "properties": {"color": {"enum": ["red", "green", "blue"]},
                    "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["color", "size"]},
    {"type": "object",        # arrays of numbers, bounded
     "properties": {"scores": {"type": "array", "items": {"type": "number"},
                               "minItems": 1, "maxItems": 4}},
     "required": ["scores"]},
    {"type": "object",        # numbers and booleans
     "properties": {"price": {"type": "number"}, "in_stock": {"type": "boolean"},
                    "count": {"type": "integer"}},
     "required": ["price", "in_stock", "count"]},
    {"type": "array",         # an array of objects with an enum inside
     "items": {"type": "object",
               "properties": {"id": {"type": "integer"},
                              "kind": {"enum": ["cat", "dog"]}},
               "required": ["id", "kind"]},
     "minItems": 1, "maxItems": 3},
]
PROMPTS = ["Describe a customer as JSON.", "Give the record in JSON format:",
           "Output JSON for this item.", "JSON:", "Here is the data as JSON:",
           "Write a JSON value.", "Answer only with JSON.", "Fill in the JSON fields:",
           "Return structured data.", "The result, in JSON:"]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512)


def test_sampled_generations_against_five_schemas_all_parse_and_validate(llm):
    params = [SamplingParams(max_tokens=200, temperature=0.8, seed=i,
                             structured_outputs={"json": schema})
              for schema in SCHEMAS for i in range(len(PROMPTS))]
    prompts = [p for _ in SCHEMAS for p in PROMPTS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 50
    for i, out in enumerate(outs):
        schema = SCHEMAS[i // len(PROMPTS)]
        assert out.finish_reason == "stop", (i, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    # Sampling still samples: the outputs of one schema are not all the same.
    assert all(len({o.text for o in outs[k:k + 10]}) > 1 for k in range(0, 50, 10))


def test_regex_and_choice_outputs_match(llm):
    regex = r"[A-Z][a-z]{2,8} \d{1,3}(\.\d)?"
    choices = ["Paris", "London", "Rome", "Berlin"]
    params = ([SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                              structured_outputs=StructuredOutputsParams(regex=regex))
               for i in range(6)]
              + [SamplingParams(max_tokens=30, temperature=1.0, seed=i,
                                structured_outputs=StructuredOutputsParams(choice=choices))
                 for i in range(6)])
    outs = llm.generate(["A name and a number:"] * 6 + ["The capital of France is"] * 6,
                        params, use_tqdm=False)
    for out in outs[:6]:
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text
    for out in outs[6:]:
        assert out.text in choices and out.finish_reason == "stop", out.text


def test_a_grammar_and_any_json_object(llm):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    [g, j] = llm.generate(["Is it raining?", "A JSON object:"], [
        SamplingParams(max_tokens=10, temperature=0.0,
                       structured_outputs={"grammar": grammar}),
        SamplingParams(max_tokens=100, temperature=0.0,
                       structured_outputs={"json_object": True})], use_tqdm=False)
    assert re.fullmatch(r"yes|no|maybe [0-9]", g.text), g.text
    assert isinstance(json.loads(j.text), dict) and j.finish_reason == "stop"


def test_the_constraint_changes_what_greedy_decoding_says(llm):
    """Greedy without a grammar answers in prose; with one, only the allowed words."""
    prompt = "The capital of France is"
    [free, held] = llm.generate([prompt, prompt], [
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=0.0,
                       structured_outputs={"choice": ["Berlin", "Madrid"]})], use_tqdm=False)
    assert free.text.startswith(" Paris") and held.text in ("Berlin", "Madrid")


def test_complete_grammar_ends_the_request_even_with_ignore_eos(llm):
    [out] = llm.generate(["Pick:"], SamplingParams(
        max_tokens=50, temperature=0.0, ignore_eos=True,
        structured_outputs={"choice": ["alpha", "beta"]}), use_tqdm=False)
    assert out.finish_reason == "stop" and out.text in ("alpha", "beta")
    assert len(out.token_ids) < 50


def test_n_completions_each_follow_the_grammar(llm):
    [out] = llm.generate(["JSON:"], SamplingParams(
        n=4, max_tokens=120, temperature=1.0, seed=3,
        structured_outputs={"json": SCHEMAS[1]}), use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS[1])


def _record_split_steps(engine) -> list[str]:
    """The order of the engine's forward-pass submits, reads of a step's tokens and
    sampling submits, as a list the engine appends to."""
    calls = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped
    runner = engine.runner
    runner.submit_forward = spy("forward", runner.submit_forward)
    runner.submit_sample = spy("sample", runner.submit_sample)
    engine._finish = spy("read", engine._finish)
    return calls


def test_async_scheduling_gives_the_same_tokens_and_compiles_nothing():
    """Grammar rows need their last token for their mask only: under async scheduling a
    step's forward pass is dispatched first, then the step before is read and its tokens
    accepted, then the masks filled and the sampling dispatched (on the dispatch thread
    here, as on the GPU). The tokens equal synchronous stepping's, with unconstrained rows
    beside them. A warmed engine compiles nothing for them."""
    params = [SamplingParams(max_tokens=40, temperature=0.7, seed=i,
                             structured_outputs={"json": SCHEMAS[i]} if i % 2 else None)
              for i in range(4)]
    got = {}
    for async_ in (True, False):
        llm = LLM("smollm2", engine_config=EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
            async_scheduling=async_, warmup=True))
        if async_:
            llm.engine.runner.start_dispatch_thread()
            calls = _record_split_steps(llm.engine)
        before = CompileCounter.count()
        got[async_] = [o.token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]
        assert CompileCounter.count() == before
    assert got[True] == got[False]
    split = "".join(c[0] for c in calls).count("frs")    # forward, read, sample
    assert split >= 30 and calls.count("forward") == calls.count("sample") == split, calls
    for i in (1, 3):
        jsonschema.validate(json.loads(llm.tokenizer.decode(got[True][i])), SCHEMAS[i])


def test_offline_jsonl_lines_take_structured_outputs_and_response_format(llm, tmp_path):
    """jaxinfer's line format (structured_outputs) and OpenAI's batch format (response_format)
    in one file: both answers validate; a line whose regex does not compile is reported with
    its line number and field, and the other lines still run."""
    import io

    from jaxinfer.batch_generate import generate_file
    lines = [
        {"id": "so", "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 0.7, "seed": 1,
         "structured_outputs": {"json": SCHEMAS[0]}},
        {"custom_id": "rf", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "A shirt as JSON."}], "max_tokens": 80,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "shirt", "schema": SCHEMAS[1]}}}},
        {"id": "bad", "prompt": "x", "structured_outputs": {"regex": "(a"}},
    ]
    inp, out, log = tmp_path / "in.jsonl", tmp_path / "out.jsonl", io.StringIO()
    inp.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    summary = generate_file(llm.engine, inp, out, SamplingParams(), log=log)
    results = {r.get("custom_id") or r["id"]: r
               for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"so", "rf"} and summary["rejected"] == 1
    jsonschema.validate(json.loads(results["so"]["text"]), SCHEMAS[0])
    body = results["rf"]["response"]["body"]
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMAS[1])
    assert re.search(r"line 3\b.*structured_outputs\.regex", log.getvalue()), log.getvalue()


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_specs_that_do_not_compile_are_refused_before_queueing(llm, spec, field):
    engine = llm.engine
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("x", SamplingParams(structured_outputs=spec))
    assert e.value.field == field and "does not compile" in str(e.value)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("spec, field, kind", [
    ({}, "structured_outputs", InvalidRequestError),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs", InvalidRequestError),
    ({"json": "{not json"}, "structured_outputs.json", InvalidRequestError),
    ({"json": 5}, "structured_outputs.json", InvalidTypeError),
    ({"choice": "red"}, "structured_outputs.choice", InvalidTypeError),
    ({"choice": []}, "structured_outputs.choice", InvalidRequestError),
    ({"regex": ""}, "structured_outputs.regex", InvalidRequestError),
    ({"json_object": "yes"}, "structured_outputs.json_object", InvalidTypeError),
    ({"jsn": {}}, "structured_outputs.jsn", InvalidRequestError),
])
def test_bad_structured_outputs_name_the_field(spec, field, kind):
    with pytest.raises(kind) as e:
        SamplingParams(structured_outputs=spec)
    assert e.value.field == field


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    assert e.value.field == "min_tokens"


def test_a_model_without_a_tokenizer_refuses_structured_outputs():
    llm = LLM("tiny", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        llm.engine.add_request({"prompt_token_ids": [1, 2]},
                               SamplingParams(structured_outputs={"regex": "a"}))


def test_the_sampler_masks_every_token_whose_bit_is_clear():
    import jax.numpy as jnp

    from jaxinfer.sampling import mask_disallowed
    rng = np.random.default_rng(0)
    v = 70                                              # 3 words, the last one partial
    allowed = rng.random((4, v)) < 0.3
    packed = np.zeros((4, 3), np.uint32)
    for b, t in zip(*np.nonzero(allowed)):
        packed[b, t // 32] |= np.uint32(1 << (t % 32))
    logits = rng.normal(size=(4, v)).astype(np.float32)
    got = np.asarray(mask_disallowed(jnp.asarray(logits), jnp.asarray(packed.view(np.int32))))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
