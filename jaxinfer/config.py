"""Frozen configuration: the model's shape (ModelConfig) and how the engine runs it
(EngineConfig).

Both are validated once at construction; nothing mutates them afterwards. Only the CLI reads
argv/env and turns them into these objects.
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Mapping

from jaxinfer.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_position_embeddings"):
            if int(getattr(self, field)) < 1:
                raise ConfigError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        e, f, v, l = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        per_layer = e * (self.q_size + 2 * self.kv_size) + self.q_size * e + 3 * e * f + 2 * e
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        head = 0 if self.tie_word_embeddings else e * v
        return v * e + l * per_layer + e + head

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "model") -> "ModelConfig":
        model_type = d.get("model_type", "llama")
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise ConfigError(f"unsupported architecture {model_type!r} (model_type in "
                              f"config.json); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rs = d.get("rope_scaling") or None
            rope_scaling = None
            if rs and rs.get("rope_type", rs.get("type")) == "llama3":
                rope_scaling = RopeScaling(
                    float(rs["factor"]), float(rs["low_freq_factor"]),
                    float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
            elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
                raise ConfigError(f"unsupported rope_scaling {rs!r}")
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            return cls(
                name=name,
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads", num_heads)),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                intermediate_size=int(d["intermediate_size"]),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=bool(d.get("qkv_bias", arch == "qwen2")),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing required field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no model config at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        name = d.get("name") or (path.parent.name if path.name == "config.json" else path.stem)
        return cls.from_hf_dict(d, name=name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)


STANDARD_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "checkpoints" / "configs"


def standard_config(name: str) -> ModelConfig:
    """One of the standard shapes shipped in checkpoints/configs/ (llama-3-8b, ...)."""
    path = STANDARD_CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in STANDARD_CONFIGS_DIR.glob("*.json"))
        raise ConfigError(f"unknown standard shape {name!r}; known: {', '.join(known)}")
    return ModelConfig.from_json(path)


DTYPES = ("auto", "float32", "bfloat16")
WEIGHT_FORMATS = ("bf16", "fp8")
# The most rows a step at which the int8 LM head beat the bf16 head on the H200 (Llama-3-8B's
# head; from 128 rows the bf16 head is faster: docs/performance.md).
INT8_HEAD_MAX_ROWS = 64
LM_HEADS = ("bf16", "int8", "auto")
KV_DTYPES = ("auto", "bf16", "fp8")
KV_SCALES = ("static", "token")
ATTENTION_IMPLS = ("auto", "reference", "pallas")
SPECULATIVE_METHODS = ("ngram", "self", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Static for the engine's lifetime (changing any field means
    a new engine and new compiled steps)."""

    page_size: int = 16
    num_pages: int = 0            # 0: derive from max_num_seqs * max_model_len
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    dtype: str = "auto"           # activations / compute dtype; auto: bfloat16 on a GPU, else float32
    weights: str = "bf16"         # linear weights: "bf16" (= dtype) or "fp8" (e4m3, per-channel scales)
    kv_dtype: str = "auto"        # "auto" (= dtype), "bf16", "fp8"
    # The LM head: "bf16" (= dtype, the tied embedding where the model ties it) or "int8"
    # (codes per vocab row, max/127 scales: model.Decoder's int8_head; a checkpoint's own
    # calibrated int8 head where it has one, else rounded to nearest at load). int8 is for
    # small batches: on the H200 its GEMM (XLA's, codes widened in the operand) reads half
    # the bytes up to ~64 rows a step but runs ~1.6x the bf16 head's time at 256-512 rows,
    # where the head is compute-bound; hence the warning.
    # "auto": the int8 head's values everywhere, read as codes by steps of up to
    # INT8_HEAD_MAX_ROWS rows and from a bf16 copy of the dequantized codes by larger ones (a
    # plain float dot, the bf16 head's form, which XLA runs through cuBLAS): the int8 head's
    # speed at small batches and the bf16 head's at large ones, for the copy's memory (2
    # bytes a weight).
    lm_head: str = "bf16"
    # FP8 KV scales (kv_cache.py): "static", one per layer and kv head, calibrated when the
    # runner starts (kv_calibration.py); "token", one per token and kv head. bf16 KV: unused.
    kv_scales: str = "static"
    attention_impl: str = "auto"  # "auto": Pallas on GPU, plain-jnp reference elsewhere
    enable_prefix_caching: bool = True
    # Inter-token latency target (slo.py): a step that carries running requests is kept under
    # this many milliseconds, as the step-time model predicts, by giving prefills fewer of
    # its tokens (never fewer than max(page_size, max_num_batched_tokens // 16) beside the
    # decode rows, so prompts still drain). 0: off, every step takes the whole budget.
    itl_target_ms: float = 0.0
    tensor_parallel: int = 1
    # Python loop over per-layer weights instead of lax.scan over stacked ones (model.py).
    # None: unrolled on a GPU (scan slices copy every layer's weights there, ~2x the bytes
    # of a decode step), scanned elsewhere (faster compiles); resolved when the model is built.
    unroll_layers: bool | None = None
    # Prepare step t+1 on the host while step t runs on the device (engine.py's module doc).
    async_scheduling: bool = True
    seed: int = 0
    # JAX's persistent compilation cache (compile_cache.py): "auto" (the directory JAX is
    # configured with, else ~/.cache/jaxinfer/xla), "off", or a directory.
    compile_cache: str = "auto"
    # Compile every bucket when the engine is built (LLM, `jaxinfer generate`), so no request
    # compiles; None: on a GPU. The server always warms up before it reports SERVING.
    warmup: bool | None = None
    # LoRA adapters (lora.py): device slots for adapters in use at once (0: LoRA off, the
    # step has no LoRA work at all), their largest rank, and adapters kept in host memory
    # (0: as many as max_loras).
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # Speculative decoding (speculative.py): up to num_speculative_tokens tokens proposed per
    # row and step (0: off) by `speculative_method`, all scored in one step and accepted by
    # the rejection rule (outputs keep the model's distribution: greedy ones are identical).
    # "ngram" proposes what followed the latest earlier occurrence of the context's last
    # prompt_lookup_max .. prompt_lookup_min tokens; "self" drafts greedily with the model's
    # first speculative_draft_layers layers (0: half of them) and its LM head, on the device;
    # "draft" drafts greedily with the model speculative_model (any source load_model takes,
    # the same vocabulary), which keeps its own K/V pool on the same pages (draft_model.py).
    # Steps of more than speculative_disable_batch_size rows do not speculate.
    num_speculative_tokens: int = 0
    speculative_method: str = "ngram"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_draft_layers: int = 0
    speculative_model: str = ""
    speculative_disable_batch_size: int = 8

    def __post_init__(self):
        def check(cond, msg):
            if not cond:
                raise ConfigError(msg)
        check(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
              f"page_size must be a power of two, got {self.page_size}")
        check(self.max_model_len >= 1, f"max_model_len must be >= 1, got {self.max_model_len}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(self.num_pages == 0 or self.num_pages >= 2,
              f"num_pages must be 0 (derive) or >= 2 (page 0 is reserved), got {self.num_pages}")
        check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        check(self.weights in WEIGHT_FORMATS,
              f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        check(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        check(self.lm_head in LM_HEADS,
              f"lm_head must be one of {LM_HEADS}, got {self.lm_head!r}")
        if self.lm_head == "int8" and self.max_num_seqs > INT8_HEAD_MAX_ROWS:
            warnings.warn(f"lm_head='int8' with max_num_seqs={self.max_num_seqs}: above "
                          f"~{INT8_HEAD_MAX_ROWS} rows a step the int8 head is slower than "
                          "the bf16 one (on the H200, ~1.6x its time at 256-512 rows); it "
                          "pays at small batches (lm_head='auto' switches to a float copy "
                          "of it above that)", stacklevel=3)
        check(self.kv_scales in KV_SCALES,
              f"kv_scales must be one of {KV_SCALES}, got {self.kv_scales!r}")
        check(self.attention_impl in ATTENTION_IMPLS,
              f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        check(self.tensor_parallel >= 1, f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        check(self.unroll_layers in (None, True, False),
              f"unroll_layers must be None (auto), True or False, got {self.unroll_layers!r}")
        check(self.warmup in (None, True, False),
              f"warmup must be None (auto), True or False, got {self.warmup!r}")
        check(isinstance(self.max_loras, int) and self.max_loras >= 0,
              f"max_loras must be >= 0 (0: LoRA off), got {self.max_loras!r}")
        check(isinstance(self.max_lora_rank, int) and 1 <= self.max_lora_rank <= 64,
              f"max_lora_rank must be in [1, 64], got {self.max_lora_rank!r}")
        check(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= 0,
              f"max_cpu_loras must be >= 0 (0: max_loras), got {self.max_cpu_loras!r}")
        check(isinstance(self.num_speculative_tokens, int)
              and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
              f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0: off), got "
              f"{self.num_speculative_tokens!r}")
        check(self.speculative_method in SPECULATIVE_METHODS,
              f"speculative_method must be one of {SPECULATIVE_METHODS}, got "
              f"{self.speculative_method!r}")
        check(isinstance(self.prompt_lookup_min, int) and isinstance(self.prompt_lookup_max, int)
              and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
              f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
              f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        check(isinstance(self.speculative_draft_layers, int) and self.speculative_draft_layers >= 0,
              f"speculative_draft_layers must be >= 0 (0: half the model's layers), got "
              f"{self.speculative_draft_layers!r}")
        check(not (self.num_speculative_tokens and self.speculative_method == "draft")
              or (isinstance(self.speculative_model, str) and self.speculative_model.strip()),
              "speculative_method 'draft' needs speculative_model: the model that drafts")
        check(isinstance(self.itl_target_ms, (int, float)) and not isinstance(
            self.itl_target_ms, bool) and 0 <= self.itl_target_ms < float("inf"),
              f"itl_target_ms must be a number >= 0 (0: off), got {self.itl_target_ms!r}")
        check(isinstance(self.speculative_disable_batch_size, int)
              and self.speculative_disable_batch_size >= 1,
              f"speculative_disable_batch_size must be >= 1, got "
              f"{self.speculative_disable_batch_size!r}")
        if self.num_speculative_tokens:
            rows = min(self.speculative_disable_batch_size, self.max_num_seqs)
            check(rows * (self.num_speculative_tokens + 1) <= self.max_num_batched_tokens,
                  f"a speculative step of {rows} rows (speculative_disable_batch_size, at most "
                  f"max_num_seqs) x {self.num_speculative_tokens + 1} tokens "
                  f"(num_speculative_tokens + 1) exceeds max_num_batched_tokens "
                  f"{self.max_num_batched_tokens}")
        check(isinstance(self.compile_cache, str) and self.compile_cache.strip() != "",
              f"compile_cache must be 'auto', 'off' or a directory, got {self.compile_cache!r}")

    @property
    def speculative_rows(self) -> int:
        """The most rows a speculative step has (0: speculation off)."""
        return (min(self.speculative_disable_batch_size, self.max_num_seqs)
                if self.num_speculative_tokens else 0)

    def draft_layers(self, num_layers: int) -> int:
        """Layers self-speculation drafts with, for a model of `num_layers`."""
        return self.speculative_draft_layers or max(1, num_layers // 2)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def total_pages(self) -> int:
        return self.num_pages or self.max_num_seqs * self.pages_per_seq + 1

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    def for_backend(self, backend: str) -> "EngineConfig":
        """This config with its backend-dependent defaults (dtype "auto", warmup None)
        resolved for `backend` ("gpu", "cpu", ...)."""
        gpu = backend == "gpu"
        dtype = ("bfloat16" if gpu else "float32") if self.dtype == "auto" else self.dtype
        warmup = gpu if self.warmup is None else self.warmup
        if (dtype, warmup) == (self.dtype, self.warmup):
            return self
        return self.replace(dtype=dtype, warmup=warmup)
