"""lora_layers.delta's two forms (slots gathered for 2T < N, every slot masked otherwise)
against a per-token numpy reference on random data."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import lora_layers


@pytest.mark.parametrize("tokens", [1, 4, 5, 9])
def test_each_token_gets_its_own_slot_s_update(tokens):
    rng = np.random.default_rng(tokens)
    din, dout, n, r = 12, 10, 4, 3
    a = rng.standard_normal((din, n, r)).astype(np.float32)
    b = rng.standard_normal((n, r, dout)).astype(np.float32)
    x = rng.standard_normal((tokens, din)).astype(np.float32)
    index = rng.integers(-1, n, tokens).astype(np.int32)
    index[0] = -1
    got = np.asarray(lora_layers.delta(jnp.asarray(x), (jnp.asarray(a), jnp.asarray(b)),
                                       jnp.asarray(index)))
    want = np.stack([np.zeros(dout, np.float32) if s < 0 else x[t] @ a[:, s] @ b[s]
                     for t, s in enumerate(index)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shards", [1, 2])
def test_group_updates_match_each_module_s_in_the_fused_layout(shards):
    """One adapter (q, v, gate, up and down targeted at ranks below the slot's; k and o
    not) in a slot of the grouped layout: each group's update equals its modules' own x @ A
    @ B, placed as the fused projection lays them out (shard-major under `shards`), zeros for
    the modules the adapter leaves alone, and nothing for tokens of another slot."""
    from jaxinfer.config import EngineConfig, standard_config
    from jaxinfer.lora import LoRAAdapter, module_shapes

    cfg = standard_config("tiny")
    shapes, rank, n = module_shapes(cfg), 4, 3
    rng = np.random.default_rng(shards)
    weights = {m: (rng.standard_normal((cfg.num_layers, shapes[m][0], 3)).astype(np.float32),
                   rng.standard_normal((cfg.num_layers, 3, shapes[m][1])).astype(np.float32))
               for m in ("q", "v", "gate", "up", "down")}
    adapter = LoRAAdapter(name="a", path="", rank=3, scaling=1.0, weights=weights)
    stacked = lora_layers.allocate(cfg, EngineConfig(max_loras=n, max_lora_rank=rank),
                                   jnp.float32, False)
    host = lora_layers.host_slot(adapter, cfg, rank, np.float32,
                                 {"attn": shards, "mlp": shards})
    stacked = lora_layers.write_slot(stacked, np.int32(1), host)
    index = jnp.asarray([1, 0, -1, 1, 2], jnp.int32)
    for group, (mods, _) in lora_layers.GROUPS.items():
        din = shapes[mods[0]][0]
        x = rng.standard_normal((5, din)).astype(np.float32)
        layer = {g: (a[1], b[1]) for g, (a, b) in stacked.items()}       # layer 1
        got = np.asarray(lora_layers.fused_delta(jnp.asarray(x),
                                                 lora_layers.StepLoRA(layer, index), group))
        parts = [x @ weights[m][0][1] @ weights[m][1][1] if m in weights
                 else np.zeros((5, shapes[m][1]), np.float32) for m in mods]
        want = np.concatenate([p.reshape(5, shards, -1) for p in parts], -1).reshape(5, -1)
        want[[1, 2, 4]] = 0.0                  # slot 0 and 2 are empty, -1 is no adapter
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert np.abs(want).max() > 0.1 or group == "o"
