"""One process of a multi-process engine on the CPU (tests/engine/test_multihost.py):

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON [DIE_AFTER]

Each process has 2 CPU devices and joins the job over loopback (gloo collectives); the tiny
model is tensor-parallel over all of them. Process 0 runs the engine on the requests of
`requests()` and writes each one's tokens to OUT_JSON; the others follow it. DIE_AFTER (a
follower's): it exits abruptly when the leader's message number DIE_AFTER arrives.
With JAXINFER_TEST_HF_DIR set, the model is that HF model dir, loaded as `jaxinfer` loads it,
and each process writes the weight bytes it read to OUT_JSON.bytesPROCESS_ID."""
import json
import os
import sys

if __name__ == "__main__":    # never in a test process importing this module for engine()
    os.environ["XLA_FLAGS"] = " ".join(   # the test process's flags (its optimization level)
        [f for f in os.environ.get("XLA_FLAGS", "").split()
         if not f.startswith("--xla_force_host_platform_device_count")]
        + ["--xla_force_host_platform_device_count=2"])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from jaxinfer import multihost  # noqa: E402

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=4)


def requests():
    """(prompt, SamplingParams fields): greedy, seeded sampling, logprobs, n > 1."""
    from engine_util import random_prompts
    prompts = random_prompts(6, lo=3, hi=60, seed=13)
    params = [dict(temperature=0.0, max_tokens=12, ignore_eos=True),
              dict(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
              dict(temperature=0.0, max_tokens=8, ignore_eos=True, n=2),
              dict(temperature=0.9, top_k=20, seed=9, max_tokens=14, ignore_eos=True),
              dict(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=1),
              dict(temperature=0.0, max_tokens=16, ignore_eos=True)]
    return prompts, params


def engine(tp: int, hf_dir: str | None = None):
    import jax.numpy as jnp
    from checkpoints.model_state import build_model
    from dense_reference import random_flat
    from engine_util import TINY
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine import Engine
    from jaxinfer.sharding import make_layout
    cfg = EngineConfig(**ENGINE, tensor_parallel=tp)
    if hf_dir:
        from jaxinfer.loading import load_model
        model_cfg, graphdef, params, _ = load_model(hf_dir, cfg)
        return model_cfg, cfg, graphdef, params, Engine
    graphdef, params = build_model(TINY, random_flat(TINY, seed=11, std=0.08), jnp.float32,
                                   layout=make_layout(TINY, tp))
    return TINY, cfg, graphdef, params, Engine


def run(engine_, warm: bool = True) -> list:
    """Each request's completions' tokens, in request order."""
    from jaxinfer.request import SamplingParams
    if warm:
        engine_.warmup(progress=False)
    prompts, params = requests()
    ids = [engine_.add_request(p, SamplingParams(**kw)) for p, kw in zip(prompts, params)]
    done = engine_.run_until_done(use_tqdm=False)
    return [[c.token_ids for c in done[i].outputs] for i in ids]


def _die_after(n: int) -> None:
    recv, count = multihost.Channel.recv, [0]

    def dying(self):
        count[0] += 1
        if count[0] == n:
            print("follower exits", flush=True)
            os._exit(9)
        return recv(self)
    multihost.Channel.recv = dying


def main():
    pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    multihost.initialize(multihost.DistributedConfig(f"127.0.0.1:{port}", nproc, pid,
                                                     heartbeat_timeout_s=10))
    tp = jax.device_count()
    hf_dir = os.environ.get("JAXINFER_TEST_HF_DIR")
    model_cfg, cfg, graphdef, params, Engine = engine(tp, hf_dir)
    if hf_dir:
        from checkpoints import lazy
        with open(f"{out}.bytes{pid}", "w") as f:
            json.dump(lazy.bytes_read(), f)
    if pid == 0:
        eng = Engine(model_cfg, cfg, graphdef, params)
        tokens = run(eng)
        eng.release_followers()
        with open(out, "w") as f:
            json.dump({"tokens": tokens, "devices": jax.device_count()}, f)
    else:
        if len(sys.argv) > 5:
            _die_after(int(sys.argv[5]))
        from jaxinfer.buckets import Buckets
        from jaxinfer.runner import ModelRunner
        runner = ModelRunner(model_cfg, cfg, graphdef, params)
        multihost.follow(runner, Buckets.from_config(cfg.for_backend(jax.default_backend()))
                         .all_buckets())
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
