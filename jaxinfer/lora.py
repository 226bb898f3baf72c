"""LoRA adapters on the host (no jax): read from PEFT's format and checked against the model
(`read_peft`), registered by name with an LRU of their weights in host memory
(`LoRARegistry`), and given one of the engine's `max_loras` device slots while requests use
them (`LoRASlots`, the scheduler's).

An adapter is one directory as `peft`'s `save_pretrained` writes it: adapter_config.json
(peft_type LORA, r, lora_alpha, use_rslora, target_modules) and adapter_model.safetensors
(`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r],
likewise k/v/o and mlp.gate/up/down). The update of a targeted projection is
x @ A.T @ B.T * scaling, scaling = lora_alpha / r (/ sqrt(r) with use_rslora): its A is
kept as [L, in, r] and its B as [L, r, out] with the scaling folded in, zero-padded to the
engine's max_lora_rank (exact: the padding adds zeros). Modules and layers an adapter does
not target are zero, so one fixed set of device arrays serves every adapter.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.errors import ConfigError, InvalidRequestError

# The projections an adapter may target, by PEFT's module names (q_proj, ..., down_proj).
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
MAX_RANK = 64
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\."
                  r"(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.lora_([AB])\.weight$")
# adapter_config.json settings whose math is not served here: refused when set
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "a LoRA bias",
                "modules_to_save": "modules_to_save (fully trained extra modules)",
                "layer_replication": "layer_replication", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "trainable_token_indices":
                "trainable_token_indices", "target_parameters": "target_parameters"}


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM names it: `lora_name` (what requests and the
    servers' `model` field call it) and `lora_path` (its PEFT directory; loaded on first use
    when the name is not loaded yet). lora_int_id is accepted for vLLM's signature."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA may target, as HF's Linear modules have them."""
    e, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e), "gate": (e, f),
            "up": (e, f), "down": (f, e)}


@dataclasses.dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # module -> (A [L, in, rank], B [L, rank, out] times scaling), float32; absent: untargeted
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _bad(name: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {name!r}: {msg}", field="lora_path")


def read_peft(name: str, path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT directory `path`, checked against `cfg` (the base model) and the
    engine's `max_rank`. Every problem is an InvalidRequestError naming the adapter and what
    is wrong with it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    d = Path(path)
    conf_path, weights_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    for p in (conf_path, weights_path):
        if not p.is_file():
            raise _bad(name, f"{p.name} not found in {str(d)!r} (a directory as peft's "
                             f"save_pretrained writes it)")
    try:
        conf = json.loads(conf_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(name, f"adapter_config.json does not parse: {e}") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise _bad(name, f"peft_type is {conf.get('peft_type') if isinstance(conf, dict) else conf!r}"
                         f"; only LORA adapters are served")
    for key, what in _UNSUPPORTED.items():
        if conf.get(key):
            raise _bad(name, f"{what} is not supported (adapter_config.json sets {key})")
    rank, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _bad(name, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _bad(name, f"rank {rank} exceeds max_lora_rank {max_rank} (raise --max-lora-rank"
                         f", at most {MAX_RANK})")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _bad(name, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise _bad(name, f"adapter_model.safetensors does not load: {e}") from None
    return LoRAAdapter(name, str(d), rank, float(scaling),
                       _stack(name, tensors, cfg, rank, scaling))


def _stack(name, tensors: dict, cfg: ModelConfig, rank: int, scaling: float):
    """PEFT's per-layer tensors -> module -> (A [L, in, r], B [L, r, out] * scaling)."""
    shapes, layers = module_shapes(cfg), cfg.num_layers
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _bad(name, f"tensor {key!r} is not a LoRA A/B of a q/k/v/o/gate/up/down "
                             f"projection of a decoder layer")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= layers:
            raise _bad(name, f"tensor {key!r}: layer {layer}, but the model has {layers}")
        din, dout = shapes[module]
        want = (rank, din) if which == "A" else (dout, rank)
        if tuple(t.shape) != want:
            raise _bad(name, f"tensor {key!r} has shape {tuple(t.shape)}; the base model "
                             f"({cfg.name}) with r={rank} needs {want}")
        if module not in out:
            out[module] = (np.zeros((layers, din, rank), np.float32),
                           np.zeros((layers, rank, dout), np.float32))
        a, b = out[module]
        if which == "A":
            a[layer] = np.asarray(t, np.float32).T
        else:
            b[layer] = np.asarray(t, np.float32).T * scaling
    if not out:
        raise _bad(name, "adapter_model.safetensors holds no LoRA weights")
    return out


class LoRARegistry:
    """The adapters an engine serves, by name. Loading reads and checks an adapter; its
    weights stay in an LRU of `max_cpu_loras` adapters and are read again from disk when a
    request needs one that fell out. Each load gets a key of its own (`key_of`): requests
    carry it, so an adapter unloaded and loaded again under its name is never confused with
    the old one (in the prefix cache, in a device slot)."""

    def __init__(self, cfg: ModelConfig, max_rank: int, max_cpu_loras: int):
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self._keys: dict[str, str] = {}          # name -> key of its current load
        self._paths: dict[str, tuple[str, str]] = {}   # key -> (name, path), kept for requests
        self._host: collections.OrderedDict[str, LoRAAdapter] = collections.OrderedDict()
        self._serial = itertools.count(1)

    def load(self, name: str, path) -> LoRAAdapter:
        """Read, check and register the adapter at `path` as `name` (InvalidRequestError if
        it does not fit the model, or if the name is taken)."""
        self._check_name(name)
        return self.add(self.read(name, path))

    def read(self, name: str, path) -> LoRAAdapter:
        """The adapter at `path`, read and checked, not registered: safe from any thread
        (servers read off the engine's thread, then `add` on it)."""
        self._check_name(name)
        return read_peft(name, path, self.cfg, self.max_rank)

    def add(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Register an adapter `read` returned, under its name."""
        name = adapter.name
        self._check_name(name)
        key = f"{name}#{next(self._serial)}"
        self._keys[name] = key
        self._paths[key] = (name, adapter.path)
        self._keep(key, adapter)
        return adapter

    def _check_name(self, name) -> None:
        if not isinstance(name, str) or not name or name != name.strip():
            raise InvalidRequestError(f"a LoRA adapter name is a non-empty string without "
                                      f"surrounding spaces, got {name!r}", field="lora_name")
        if name in self._keys:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded "
                                      f"(unload it first)", field="lora_name")

    def unload(self, name: str) -> None:
        """Stop serving `name`: new requests cannot name it; requests already queued with it
        finish with it."""
        key = self._keys.pop(name, None)
        if key is None:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded",
                                      field="lora_name")
        self._host.pop(key, None)

    def key_of(self, name: str) -> str:
        """The key requests naming `name` carry (InvalidRequestError if not loaded)."""
        key = self._keys.get(name)
        if key is None:
            loaded = ", ".join(sorted(self._keys)) or "none"
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                      f"{loaded})", field="lora")
        return key

    def name_of(self, key: str) -> str:
        return self._paths[key][0]

    @property
    def names(self) -> list[str]:
        return list(self._keys)

    def path_of(self, name: str) -> str:
        return self._paths[self.key_of(name)][1]

    def weights(self, key: str) -> LoRAAdapter:
        """The adapter of `key`, from the LRU or read again from its directory."""
        adapter = self._host.get(key)
        if adapter is None:
            name, path = self._paths[key]
            adapter = read_peft(name, path, self.cfg, self.max_rank)
        self._keep(key, adapter)
        return adapter

    def _keep(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)


class LoRASlots:
    """The device's `num_slots` adapter slots. A running request holds its adapter's slot
    (`enter` when it starts running, `leave` when it stops); an adapter gets a slot when it
    has one already, a free one, or the least recently used one no running request holds.
    Slots given to an adapter since the last `take_loads` are the weights to write to the
    device before the next step."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ConfigError(f"max_loras must be >= 1 with LoRA on, got {num_slots}")
        self.num_slots = num_slots
        self._slot: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU
        self._users: collections.Counter[str] = collections.Counter()
        self._loads: list[tuple[int, str]] = []

    def enter(self, key: str) -> bool:
        """A request of adapter `key` starts running: False (nothing taken) when every slot
        is held by adapters of running requests."""
        slot = self._slot.get(key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._slot[key] = slot
            self._loads.append((slot, key))
        self._slot.move_to_end(key)
        self._users[key] += 1
        return True

    def leave(self, key: str) -> None:
        self._users[key] -= 1
        if self._users[key] <= 0:
            del self._users[key]

    def forget(self, key: str) -> None:
        """Free `key`'s slot (its weights never reached it); no running request holds it."""
        if not self._users.get(key):
            self._slot.pop(key, None)

    def key_at(self, slot: int) -> str | None:
        """The adapter in `slot` (or about to be written there), None if it is empty."""
        return next((k for k, s in self._slot.items() if s == slot), None)

    def slot(self, key: str) -> int:
        return self._slot[key]

    def take_loads(self) -> list[tuple[int, str]]:
        loads, self._loads = self._loads, []
        return loads

    @property
    def num_held(self) -> int:
        """Slots that running requests hold."""
        return len(self._users)

    def _free_slot(self) -> int | None:
        taken = set(self._slot.values())
        free = next((s for s in range(self.num_slots) if s not in taken), None)
        if free is not None:
            return free
        idle = next((k for k in self._slot if k not in self._users), None)
        if idle is None:
            return None
        self._loads = [(s, k) for s, k in self._loads if k != idle]
        return self._slot.pop(idle)
