"""Host-side request types. No jax import here: these are unit-tested in milliseconds.

`SamplingParams` and `RequestOutput` cross the API boundary; `Request` is the scheduler's
private, mutable record of one request. Its central counter is `num_computed_tokens`: the
leading tokens of `all_token_ids` whose K/V already sit in the cache. Everything after them
is still to be fed, so prefill, chunked prefill, decode and recompute after preemption are one
rule: feed `all_token_ids[num_computed_tokens:]` (as much of it as the step's budget allows);
the step that reaches the end samples the next token. A request in decode has exactly one
uncomputed token, the last sampled one.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import operator
import time
from typing import Mapping, Sequence

from jaxinfer.errors import InvalidRequestError, InvalidTypeError
from jaxinfer.page_table import PageList
from jaxinfer.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_BANNED_IDS = 32   # EOS + stop_token_ids a request with min_tokens may hold back


class FinishReason(str, enum.Enum):
    STOP = "stop"          # an EOS / stop token id / stop string
    LENGTH = "length"      # max_tokens or the model's context
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"        # the engine step running it failed (RequestOutput.error says how)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Validated at construction; errors name the field."""

    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # (0, 1]
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0                # [0, 1]
    repetition_penalty: float = 1.0   # > 0; 1 = off
    presence_penalty: float = 0.0     # [-2, 2]
    frequency_penalty: float = 0.0    # [-2, 2]
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # top-n logprobs per generated token, n <= 20
    prompt_logprobs: int | None = None   # top-n logprobs per prompt token, n <= 20
    n: int = 1                        # completions of the prompt (its pages shared)
    min_tokens: int = 0               # no EOS / stop token id / stop string before this many
    include_stop_str_in_output: bool = False   # the stop string that ended it stays in text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # What the output must match (a JSON schema, regex, choice list or grammar), or None;
    # a dict of StructuredOutputsParams' fields is taken too.
    structured_outputs: StructuredOutputsParams | None = None
    # The name of a loaded LoRA adapter to answer with (Engine.load_lora), None: the base model.
    lora: str | None = None

    def __post_init__(self):
        # Accept lists from JSON / kwargs; store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop", _sequence(
            [self.stop] if isinstance(self.stop, str) else self.stop, "stop",
            "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", _sequence(
            self.stop_token_ids, "stop_token_ids", "a list of integers"))
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputsParams.coerce(self.structured_outputs))
        self._validate()

    @classmethod
    def coerce(cls, value, field: str = "sampling_params") -> "SamplingParams":
        """`value` as SamplingParams: itself, or built from a mapping of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(cls.fields()))
            if unknown:
                raise InvalidRequestError(f"{field}: unknown field {unknown[0]!r} (SamplingParams "
                                          f"has {', '.join(cls.fields())})", field=unknown[0])
            return cls(**value)
        raise InvalidTypeError(f"{field} must be a SamplingParams or a dict of its fields, "
                               f"got {type(value).__name__}", field=field)

    def _validate(self):
        def bad(field, msg, kind=InvalidRequestError):
            raise kind(f"{field} {msg}", field=field)

        def num(field):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(field, f"must be a number, got {type(v).__name__}", InvalidTypeError)
            if not math.isfinite(v):
                bad(field, f"must be a finite number, got {v!r}")
            return v

        for f in ("max_tokens", "top_k", "n", "min_tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f, f"must be an integer, got {type(v).__name__}", InvalidTypeError)
        for f in ("seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                bad(f, f"must be an integer or None, got {type(v).__name__}", InvalidTypeError)
        for f in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, f), bool):
                bad(f, f"must be a bool, got {type(getattr(self, f)).__name__}",
                    InvalidTypeError)
        if any(not isinstance(s, str) for s in self.stop):
            bad("stop", "must be a string or a list of strings", InvalidTypeError)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers", InvalidTypeError)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            bad("lora", f"must be a LoRA adapter's name or None, got {self.lora!r}",
                InvalidTypeError if not isinstance(self.lora, str) else InvalidRequestError)
        if self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens = {self.max_tokens}], got "
                              f"{self.min_tokens}")
        if self.structured_outputs is not None and self.min_tokens:
            bad("min_tokens", "cannot be combined with structured_outputs (the grammar says "
                              "where the output ends)")
        if num("temperature") < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < num("top_p") <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not (
                0 <= self.top_k < 2**31):
            bad("top_k", f"must be an integer in [0, 2**31) (0 = off), got {self.top_k!r}")
        if not 0 <= num("min_p") <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if num("repetition_penalty") <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for f in ("presence_penalty", "frequency_penalty"):
            if not -2 <= num(f) <= 2:
                bad(f, f"must be in [-2, 2], got {getattr(self, f)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**63):
            bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0
               for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got "
                                   f"{self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_completion(self, index: int) -> "SamplingParams":
        """The params of completion `index` of an n > 1 request: n = 1, and a seed of its
        own (seed + index), so seeded completions differ and each is reproducible. The
        prompt's logprobs are completion 0's alone (the others share its prompt pages)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        return dataclasses.replace(self, n=1, seed=seed,
                                   prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @classmethod
    def fields(cls) -> Sequence[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _sequence(value, field: str, what: str) -> tuple:
    """A list/tuple field as a tuple (None: empty); another type is InvalidTypeError."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise InvalidTypeError(f"{field} must be {what}, got {type(value).__name__}",
                               field=field)
    return tuple(value)


PENDING = -1  # an output token sampled on the device, not yet seen by the host


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's logprob in a logprobs dict, as vLLM's: `rank` 1 for the most likely token
    of the vocabulary (raw logits: before penalties, temperature and masks), `decoded_token`
    its text (special tokens included; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per generated token: {token id: Logprob} of the top-n and the chosen token
LogprobDicts = list[dict[int, Logprob]]
# per prompt token: {token id: Logprob} of the top-n and the prompt's token; None for the
# first token (nothing precedes it)
PromptLogprobDicts = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request, shaped as vLLM's (`RequestOutput.outputs`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None   # sum of the chosen tokens' logprobs (with logprobs)
    logprobs: LogprobDicts | None
    finish_reason: str | None          # "stop", "length", "cancelled", "error"


@dataclasses.dataclass
class RequestOutput:
    """What a request has produced so far. `new_token_ids`/`text_delta` are this step's delta;
    `token_ids`/`text`/`logprobs` accumulate (until the last output `token_ids` is the
    engine's own list, still growing: copy it to keep a snapshot). `finish_reason` is set on
    the last output. A request with n > 1 has one final output: `outputs` holds its n
    completions, and the single-completion fields are completion 0's. Stepped with deltas
    (streaming), its unfinished outputs each carry one completion's delta: `outputs` is
    that completion alone (its `index`; its `finish_reason` once it ended)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    text_delta: str = ""
    finish_reason: FinishReason | None = None
    logprobs: LogprobDicts | None = None  # per generated token: top-n {id: Logprob}
    # per prompt token (SamplingParams.prompt_logprobs), once the prompt is computed
    prompt_logprobs: PromptLogprobDicts | None = None
    prompt: str | None = None
    ttft_s: float | None = None      # time to first token
    latency_s: float | None = None   # arrival to finish
    error: str | None = None         # why, when finish_reason is ERROR
    completions: list[CompletionOutput] | None = None   # n > 1: all n (see `outputs`)
    lora: str | None = None          # the LoRA adapter that answered (its name), None: none

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completions as vLLM shapes them: a list of CompletionOutput (one unless the
        request asked for n > 1)."""
        if self.completions is not None:
            return self.completions
        return [self.completion(0)]

    def completion(self, index: int) -> CompletionOutput:
        """This output's single completion as a CompletionOutput numbered `index`."""
        cumulative = (None if self.logprobs is None else
                      sum(d[t].logprob for d, t in zip(self.logprobs, self.token_ids)))
        return CompletionOutput(index, self.text, self.token_ids, cumulative, self.logprobs,
                                None if self.finish_reason is None else str(self.finish_reason))


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"      # queued, holds no pages
    RUNNING = "running"      # holds pages, scheduled each step while the budget allows
    PREEMPTED = "preempted"  # pages taken back; waits at the head of the queue to recompute
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """Host-side state of one request; only the scheduler mutates it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    page_ids: PageList = dataclasses.field(default_factory=PageList)
    # Prefix-cache keys (page_table.page_key) of the full pages of all_token_ids, append-only
    # like the tokens; and how many leading pages of page_ids are registered in the cache.
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_pages: int = 0
    num_prefix_hit_tokens: int = 0   # tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Sampled tokens dispatched but not yet received (async scheduling): the last
    # num_pending entries of output_token_ids are PENDING placeholders.
    num_pending: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # n > 1: (request id, params) of the completions still to fork from this one once its
    # prompt is computed (Scheduler._fork); they then share its prompt's pages.
    forks: tuple[tuple[str, SamplingParams], ...] = ()
    # The key of its LoRA adapter's load (lora.LoRARegistry.key_of), None for the base model.
    lora: str | None = None
    # Speculative decoding with a draft model (draft_model.py): the leading tokens whose K/V
    # the draft model's own pool holds at this request's pages (0 again when they go).
    num_draft_computed: int = 0
    # The queue's order: lower first, then arrival (scheduler.py). Its completions share it.
    priority: int = 0
    # When it must finish, on the scheduler's clock; None: no deadline (slo.py).
    deadline: float | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, "
                                      f"got {self.request_id!r}", field="request_id")
        try:
            ids = [operator.index(t) for t in self.prompt_token_ids]
        except TypeError:
            raise InvalidRequestError("prompt token ids must be integers",
                                      field="prompt_token_ids") from None
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidTypeError(f"priority must be an integer, got "
                                   f"{type(self.priority).__name__}", field="priority")
        if not ids:
            raise InvalidRequestError("prompt is empty", field="prompt_token_ids")
        if min(ids) < 0:
            raise InvalidRequestError("prompt token ids must be >= 0", field="prompt_token_ids")
        self.prompt_token_ids = ids
        # Kept beside output_token_ids so slicing the fed tokens never concatenates.
        self.all_token_ids = ids + list(self.output_token_ids)
        # The length at which max_tokens ends it (the scheduler's per-row test: the model's
        # context, max_model_len, may end it first).
        self.max_total_tokens = len(ids) + self.sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


def rank(request: Request) -> tuple[int, float]:
    """The scheduler's order of running requests: priority (lower first), then arrival."""
    return request.priority, request.arrival_time
