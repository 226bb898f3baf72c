"""LoRA against the independent oracle: HF transformers + peft on the embedded SmolLM2 GGUF,
each adapter applied by peft, against jaxinfer serving the same adapters in one mixed batch
with base-model rows. One adapter is written by peft itself (save_pretrained), the other by
the test in PEFT's format."""
import jax.numpy as jnp
import pytest

from checkpoints import default_gguf_path
from jaxinfer import LLM, LoRARequest, SamplingParams
from lora_util import write_adapter

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(peft model holding adapters "made" and "written", tokenizer, their directories)."""
    import peft          # here, not at the top: every xdist worker imports each test file
    import torch
    import transformers

    path = default_gguf_path()
    base = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    made = peft.get_peft_model(base, peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    with torch.no_grad():     # peft's random B is large enough to drown the model
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    made.save_pretrained(root / "made")
    base = made.unload()
    from checkpoints import load_checkpoint
    cfg = load_checkpoint("smollm2", dtype=jnp.float32)[0]
    written = write_adapter(root / "written", cfg, rank=6, alpha=24, seed=4, std=0.07,
                            modules=("q", "v", "down"))
    model = peft.PeftModel.from_pretrained(base, root / "made", adapter_name="made")
    model.load_adapter(root / "written", adapter_name="written")
    model.eval()
    return model, tok, {"made": root / "made", "written": written}


def hf_greedy(model, ids, adapter):
    """peft's raw argmax continuation under `adapter` (None: adapters disabled)."""
    import contextlib

    import torch
    full = list(ids)
    if adapter is not None:
        model.set_adapter(adapter)
    ctx = model.disable_adapter() if adapter is None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        for _ in range(NEW_TOKENS):
            full.append(int(model(torch.tensor([full])).logits[0, -1].argmax()))
    return full[len(ids):]


def test_a_mixed_batch_gives_peft_s_greedy_tokens_for_each_adapter(oracle):
    model, tok, dirs = oracle
    llm = LLM("smollm2", max_loras=2, max_lora_rank=8, max_model_len=128, max_num_seqs=9,
              max_num_batched_tokens=128, page_size=4, dtype="float32")
    jobs = [(p, a) for p in PROMPTS for a in (None, "made", "written")]
    # adapters named by LoRARequests are loaded from their directories on first use
    outs = llm.generate([p for p, _ in jobs],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        lora_request=[None if a is None else LoRARequest(a, i, str(dirs[a]))
                                      for i, (_, a) in enumerate(jobs)], use_tqdm=False)
    assert llm.engine.lora_names() == ["made", "written"]
    got = {job: out.token_ids for job, out in zip(jobs, outs)}
    want = {(p, a): hf_greedy(model, tok.encode(p), a) for p, a in jobs}
    assert got == want
    for p in PROMPTS:       # each adapter changes the answer
        assert len({tuple(got[p, a]) for a in (None, "made", "written")}) == 3, p
    # by name once loaded, for every prompt alike
    again = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                 ignore_eos=True),
                         lora_request="written", use_tqdm=False)
    assert [o.token_ids for o in again] == [got[p, "written"] for p in PROMPTS]
