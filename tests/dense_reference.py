"""An independent dense (no pages, no cache) causal forward over the canonical flat params:
the oracle the paged model is checked against. Deliberately written differently from
jaxinfer.model (numpy-style, unfused projections, repeat_kv GQA)."""
import numpy as np

from jaxinfer.model import rope_inv_freq


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, inv):  # x [T, N, D]
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def dense_logits(cfg, flat, tokens):
    """tokens [T] -> logits [T, V] in float64."""
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    inv = rope_inv_freq(cfg).astype(np.float64)
    h, kh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = f["embed"][np.asarray(tokens)]
    causal = np.tril(np.ones((t, t), bool))
    for l in range(cfg.num_layers):
        a = _rms(x, f["attn_norm"][l], cfg.rms_norm_eps)
        q, k, v = a @ f["wq"][l], a @ f["wk"][l], a @ f["wv"][l]
        if cfg.qkv_bias:
            q, k, v = q + f["bq"][l], k + f["bk"][l], v + f["bv"][l]
        q = _rope(q.reshape(t, h, d), pos, inv)
        k = np.repeat(_rope(k.reshape(t, kh, d), pos, inv), h // kh, axis=1)
        v = np.repeat(v.reshape(t, kh, d), h // kh, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(causal[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(t, h * d)
        x = x + o @ f["wo"][l]
        m = _rms(x, f["mlp_norm"][l], cfg.rms_norm_eps)
        g, u = m @ f["w_gate"][l], m @ f["w_up"][l]
        x = x + (g / (1 + np.exp(-g)) * u) @ f["w_down"][l]
    x = _rms(x, f["final_norm"], cfg.rms_norm_eps)
    head = f["embed"].T if cfg.tie_word_embeddings else f["lm_head"]
    return x @ head


def random_flat(cfg, seed=0, std=0.05):
    """Random canonical weights for cfg (float32 numpy)."""
    rng = np.random.default_rng(seed)
    e, hd, kd, ff, L = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers
    shapes = {"embed": (cfg.vocab_size, e), "final_norm": (e,), "attn_norm": (L, e),
              "wq": (L, e, hd), "wk": (L, e, kd), "wv": (L, e, kd), "wo": (L, hd, e),
              "mlp_norm": (L, e), "w_gate": (L, e, ff), "w_up": (L, e, ff), "w_down": (L, ff, e)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (e, cfg.vocab_size)
    if cfg.qkv_bias:
        shapes.update(bq=(L, hd), bk=(L, kd), bv=(L, kd))
    flat = {}
    for name, shape in shapes.items():
        if name.endswith("norm"):
            flat[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            flat[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return flat
