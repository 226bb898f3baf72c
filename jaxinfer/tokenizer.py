"""Text <-> token ids: a thin wrapper over the `tokenizers` library, its chat template, and the
incremental detokenizer that turns streamed token ids into UTF-8-safe text deltas.

A GGUF file's tokenizer is rebuilt by checkpoints/gguf_tokenizer.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import tokenizers

from jaxinfer.errors import ConfigError, ModelLoadError

_META_FILE = "jaxinfer_tokenizer.json"
# `tokenizers` releases the GIL in encode_batch, not in encode: above this length (~1 ms of
# encoding) the batch form keeps the other threads (the engine's) running.
_GIL_FREE_CHARS = 4096


def _token_content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    """encode/decode, special ids and the chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Sequence[int] = (), chat_template: str | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self._template = None   # compiled on first use
        self._token_texts: dict[int, str] = {}   # token_text's cache
        self._max_token_chars: int | None = None

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """A tokenizer.json, plus the chat template and special tokens of the
        tokenizer_config.json (or chat_template.jinja) beside it, if any."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path} is not a valid tokenizer.json ({e})") from None
        conf_path = path.parent / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = path.parent / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        ids = {k: backend.token_to_id(_token_content(conf.get(k)) or "") for k in ("bos_token", "eos_token")}
        # Instruct models often list their end-of-turn ids only in generation_config.json.
        gen_path = path.parent / "generation_config.json"
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.is_file() else None
        eos = [ids["eos_token"], *(gen_eos if isinstance(gen_eos, list) else [gen_eos])]
        return cls(backend, bos_token_id=ids["bos_token"],
                   eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
                   chat_template=template)

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Read what `to_dir` wrote."""
        directory = Path(directory)
        meta_path = directory / _META_FILE
        if not meta_path.is_file():
            raise ModelLoadError(f"no saved tokenizer in {directory} (missing {_META_FILE})")
        m = json.loads(meta_path.read_text())
        backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        return cls(backend, bos_token_id=m["bos_token_id"], eos_token_ids=m["eos_token_ids"],
                   chat_template=m["chat_template"])

    def to_dir(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        (directory / _META_FILE).write_text(json.dumps(
            {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
             "chat_template": self.chat_template}, indent=1))

    # --- text <-> ids -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary entry): a text
        longer than n times this cannot fit in n tokens."""
        if self._max_token_chars is None:
            self._max_token_chars = max(
                len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to
        their ids. `add_special_tokens` adds a BOS only where the model's tokenizer does.
        Long texts are encoded without holding the GIL (other threads keep running)."""
        if len(text) > _GIL_FREE_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs' tokens), cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat, rendered with the model's Jinja chat template."""
        token = (lambda i: self.backend.id_to_token(i) if i is not None else "")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return self._compiled_template().render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=token(self.bos_token_id), eos_token=token(eos))

    def _compiled_template(self):
        """The Jinja template, compiled once (a compile costs ~2 ms: not per request)."""
        if self._template is not None:
            return self._template
        if not self.chat_template:
            raise ConfigError("this model's tokenizer has no chat template; pass a plain prompt")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(self.chat_template)
        return self._template


    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for a chat. The template writes any BOS itself, so none is added again."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    A token may end mid-character (byte-level BPE splits multibyte UTF-8), so each step decodes
    a short window of recent tokens and emits only the part past what was already emitted,
    holding back text that ends in U+FFFD until the character completes. Decoding a window
    that starts a few tokens back, not at the new token, keeps decoders that strip a leading
    space from the first token from eating real spaces.
    """

    _CONTEXT = 5  # tokens of prompt kept as decoding context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = [int(i) for i in prompt_ids[-self._CONTEXT:]]
        self.prefix_offset = 0              # start of the decoding window
        self.read_offset = len(self.ids)    # end of the text already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new complete text (may be "")."""
        self.ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (an unfinished character decodes
        as U+FFFD, as in `decode`)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]
