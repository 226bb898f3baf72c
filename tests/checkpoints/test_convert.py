"""`jaxinfer convert`: the orbax form loads back to the same weights (bf16) or the same
quantized weights (fp8), with its tokenizer, and generates."""
import numpy as np
import pytest

from checkpoints import load_checkpoint
from checkpoints.fp8 import quantize_params
from jaxinfer import LLM, SamplingParams
from jaxinfer.cli import main


@pytest.fixture(scope="module")
def source():
    return load_checkpoint("smollm2", dtype="bfloat16")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`jaxinfer convert smollm2 DST --weights W` run once per W for the module (the fp8
    checkpoint serves both tests below): W -> DST."""
    done = {}

    def get(weights):
        if weights not in done:
            dst = tmp_path_factory.mktemp(f"convert_{weights}") / "ckpt"
            assert main(["convert", "smollm2", str(dst), "--weights", weights]) == 0
            done[weights] = dst
        return done[weights]
    return get


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_convert_round_trip(converted, source, weights):
    ckpt = converted(weights)
    cfg, params, tok = load_checkpoint(ckpt)
    src_cfg, src_params, src_tok = source
    assert cfg == src_cfg
    want = quantize_params(src_params) if weights == "fp8" else src_params
    assert sorted(params) == sorted(want)
    for name, value in want.items():
        got = np.asarray(params[name])
        assert got.dtype == np.asarray(value).dtype, name
        np.testing.assert_array_equal(got.astype(np.float32),
                                      np.asarray(value).astype(np.float32), err_msg=name)
    assert tok.encode("The capital of France is") == src_tok.encode("The capital of France is")
    llm = LLM(str(ckpt), weights=weights, dtype="float32", max_model_len=64,
              max_num_seqs=1, max_num_batched_tokens=16)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0]
    assert "Paris" in out.text


def test_fp8_checkpoint_needs_fp8_engine(converted):
    assert main(["generate", "hi", "--model", str(converted("fp8")), "--max-tokens", "1"]) == 2
