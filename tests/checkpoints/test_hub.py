"""A model named by its Hugging Face Hub id ("org/name") loads from the local Hugging Face
cache, never from the network; an id that is not there is an error that says how to get it."""
import numpy as np
import pytest

from checkpoints import load_checkpoint
from jaxinfer import LLM, SamplingParams
from jaxinfer.errors import ModelLoadError
from test_checkpoints import _tiny_cfg, _write_hf_dir


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding acme/tiny-llama (a random tiny model), in the cache's own
    layout: refs/main names the snapshot directory with the files."""
    import huggingface_hub.constants
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    params = _write_hf_dir(repo / "snapshots" / "snap", _tiny_cfg(), np.random.default_rng(0))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("snap")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return params


def test_a_hub_id_loads_from_the_local_cache(hub_cache):
    cfg, params, tokenizer = load_checkpoint("acme/tiny-llama")
    assert cfg.num_layers == 2 and cfg.vocab_size == 512 and tokenizer is None
    np.testing.assert_allclose(np.asarray(params["wq"]), hub_cache["wq"], rtol=1e-6)
    llm = LLM("acme/tiny-llama", max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_a_hub_id_not_in_the_cache_says_how_to_get_it(hub_cache):
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache") as e:
        load_checkpoint("acme/absent-model")
    assert "huggingface-cli download acme/absent-model" in str(e.value)
    assert "never downloads" in str(e.value)
