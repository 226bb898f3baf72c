"""Structured output: generations held to a JSON schema, a regex, a choice list or a grammar.

`StructuredOutputsParams` (SamplingParams.structured_outputs, as vLLM names it) says what the
output must match. xgrammar (the optional extra `jaxinfer[structured]`, the library vLLM and
SGLang use) compiles it against the model's vocabulary into a grammar; each request keeps a
`GrammarMatcher` that accepts the tokens it samples and fills, before each step that samples
it, a packed bitmask of the tokens it may sample next: bit v % 32 of int32 word v // 32 for
token v, one row of the step's [B, ceil(V / 32)] mask. The jitted sampler sets every other
token's logit to -inf (sampling.py); logprobs stay raw.

A request with a grammar needs its last token accepted before its next mask exists, so steps
that run one wait for the step before them (async scheduling steps around them as it does
for penalties). When the grammar is complete and allows nothing more, the request finishes
with "stop".

Host side only: no jax. xgrammar is imported on the first grammar compiled.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Mapping

import numpy as np

from jaxinfer.errors import InvalidRequestError, InvalidTypeError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
INSTALL_HINT = "pip install 'jaxinfer[structured]'"
GRAMMAR_CACHE_BYTES = 512 << 20


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What a generation must match: set exactly one field.

    json         a JSON schema (a dict, or its JSON text; kept as text)
    regex        a regular expression the whole output matches
    choice       a list of strings, the output being one of them
    grammar      an EBNF grammar (GBNF, llama.cpp's notation) whose `root` rule is the output
    json_object  True: any JSON object

    any_whitespace: JSON (json, json_object) with any whitespace between its tokens; by
    default it is written on one line with ", " and ": " separators (small models given any
    whitespace can emit newlines until max_tokens).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = False

    def __post_init__(self):
        def bad(field, msg, kind=InvalidRequestError):
            raise kind(f"structured_outputs.{field} {msg}", field=f"structured_outputs.{field}")

        if isinstance(self.json, Mapping):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.json is not None:
            if not isinstance(self.json, str):
                bad("json", f"must be a JSON schema (an object or its JSON text), got "
                            f"{type(self.json).__name__}", InvalidTypeError)
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                bad("json", f"is not valid JSON ({e})")
            if not isinstance(schema, (dict, bool)):
                bad("json", f"must be a JSON object (a schema), got {type(schema).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes, Mapping)) or not isinstance(
                    self.choice, (list, tuple)):
                bad("choice", f"must be a list of strings, got {type(self.choice).__name__}",
                    InvalidTypeError)
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                bad("choice", "must be a non-empty list of non-empty strings")
        for f in ("regex", "grammar"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, str) or not v):
                bad(f, f"must be a non-empty string, got {v!r}",
                    InvalidTypeError if not isinstance(v, str) else InvalidRequestError)
        for f in ("json_object", "any_whitespace"):
            if not isinstance(getattr(self, f), bool):
                bad(f, f"must be a bool, got {type(getattr(self, f)).__name__}",
                    InvalidTypeError)
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}", field="structured_outputs")

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def coerce(cls, value, field: str = "structured_outputs") -> "StructuredOutputsParams":
        """`value` as StructuredOutputsParams: itself, or built from a mapping of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(map(str, set(value) - set(known)))
            if unknown:
                name = unknown[0]
                path = f"{field}.{name}" if name.isidentifier() else field
                raise InvalidRequestError(
                    f"{path}: unknown field {name!r} ({field} has {', '.join(known)})",
                    field=path)
            return cls(**value)
        raise InvalidTypeError(f"{field} must be a StructuredOutputsParams or a dict of its "
                               f"fields, got {type(value).__name__}", field=field)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidRequestError(
            f"structured_outputs needs the xgrammar package, which is not installed "
            f"({INSTALL_HINT}): {e}", field="structured_outputs") from None
    return xgrammar


class Grammars:
    """One model's grammar compiler (xgrammar's, with its cache) and the bitmask layout."""

    def __init__(self, tokenizer, vocab_size: int):
        """tokenizer: jaxinfer.tokenizer.Tokenizer (its `tokenizers` backend); vocab_size:
        the model's (the logits' width, which may exceed the tokenizer's)."""
        xgr = _xgrammar()
        backend = tokenizer.backend
        encoded = [""] * vocab_size
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(tokenizer.eos_token_ids),
                                 add_prefix_space=meta["add_prefix_space"])
        self._xgr = xgr
        # Compiled grammars are cached (a repeated schema compiles once), within a bound.
        self._compiler = xgr.GrammarCompiler(info, max_threads=4,
                                             cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self._lock = threading.Lock()     # compiles come from the servers' threads too
        # Fills the masks of a step's grammar rows together, on several threads.
        self._batch = xgr.BatchGrammarMatcher()

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (xgrammar caches repeats); InvalidRequestError naming the
        field when it does not compile."""
        kind = params.kind
        c = self._compiler
        try:
            with self._lock:
                if kind == "json":
                    return c.compile_json_schema(params.json,
                                                 any_whitespace=params.any_whitespace)
                if kind == "json_object":    # any properties: not xgrammar's strict mode
                    return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                 any_whitespace=params.any_whitespace)
                if kind == "regex":
                    return c.compile_regex(params.regex)
                if kind == "choice":
                    return c.compile_regex("|".join(_regex_literal(s) for s in params.choice))
                return c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"structured_outputs.{kind} does not compile: "
                                      f"{_first_line(e)}",
                                      field=f"structured_outputs.{kind}") from None

    def matcher(self, params: StructuredOutputsParams) -> "Matcher":
        return Matcher(self._xgr.GrammarMatcher(self.compile(params)), self._batch)


class RequestGrammars:
    """The engine's grammar requests: each one's Matcher by request id, and the model's
    Grammars, made on the first structured request (thread-safe: servers validate specs off
    the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()
        self.matchers: dict[str, Matcher] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.matchers

    def grammars(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("structured_outputs needs a tokenizer; this model "
                                              "has none", field="structured_outputs")
                self._grammars = Grammars(self._tokenizer, self._vocab_size)
            return self._grammars

    def check(self, params) -> None:
        """Compile (and cache) a SamplingParams' grammar, if it has one: InvalidRequestError
        naming the field when it does not compile."""
        if params.structured_outputs is not None:
            self.grammars().compile(params.structured_outputs)

    def add(self, request_id: str, params) -> None:
        """Start a matcher for a request whose SamplingParams have a grammar."""
        if params.structured_outputs is not None:
            self.matchers[request_id] = self.grammars().matcher(params.structured_outputs)

    def any_of(self, request_ids) -> bool:
        """Whether any of these requests has a grammar."""
        return bool(self.matchers) and any(rid in self.matchers for rid in request_ids)

    def advance(self, request_id: str, token: int) -> bool:
        """Feed a running request's sampled token to its grammar (if it has one): whether the
        grammar is now complete. A token the grammar refuses raises."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept(token):
            raise RuntimeError(f"sampled token {token}, which its grammar does not allow")
        return matcher.terminated

    def advance_all(self, pairs) -> list:
        """`advance` for many (request id, token) pairs at once (xgrammar accepts the tokens
        together): per pair, whether its grammar is now complete, or the RuntimeError of a
        token its grammar refuses; False for a request without a grammar."""
        results: list = [False] * len(pairs)
        guided = [(i, m, token) for i, (rid, token) in enumerate(pairs)
                  if (m := self.matchers.get(rid)) is not None]
        if guided:
            accepted = Matcher.accept_rows([(m, token) for _, m, token in guided])
            for (i, m, token), ok in zip(guided, accepted):
                results[i] = m.terminated if ok else RuntimeError(
                    f"sampled token {token}, which its grammar does not allow")
        return results

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)


class Matcher:
    """One generation's place in its grammar."""

    def __init__(self, matcher, batch=None):
        self._m, self._batch = matcher, batch

    def fill(self, mask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into mask[row]."""
        self._m.fill_next_token_bitmask(mask, row)

    @staticmethod
    def fill_rows(mask: np.ndarray, rows: list[tuple[int, "Matcher"]]) -> None:
        """Write each (row, matcher)'s allowed tokens into mask[row]: xgrammar fills them
        together on several threads (matchers of one model's Grammars)."""
        if len(rows) == 1 or rows[0][1]._batch is None:
            for row, m in rows:
                m.fill(mask, row)
            return
        rows[0][1]._batch.batch_fill_next_token_bitmask(
            [m._m for _, m in rows], mask, [row for row, _ in rows])

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._m.accept_token(token)

    @staticmethod
    def accept_rows(pairs: list[tuple["Matcher", int]]) -> list[bool]:
        """Advance each (matcher, token); whether each token was allowed (matchers of one
        model's Grammars: xgrammar accepts them in one call)."""
        if len(pairs) == 1 or pairs[0][0]._batch is None:
            return [m.accept(token) for m, token in pairs]
        return list(pairs[0][0]._batch.batch_accept_token([m._m for m, _ in pairs],
                                                          [token for _, token in pairs]))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted its end (a stop token): nothing may follow."""
        return self._m.is_terminated()


def _regex_literal(s: str) -> str:
    """`s` as a regex matching exactly itself."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}" else ch for ch in s)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its source location prefix ('[time] file:line: ')."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") else text
