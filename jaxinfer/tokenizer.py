"""Text <-> token ids: a thin wrapper over the `tokenizers` library, its chat template, and the
incremental detokenizer that turns streamed token ids into UTF-8-safe text deltas.

GGUF files carry no tokenizer.json; `Tokenizer.from_gguf` rebuilds the byte-level BPE from the
file's vocabulary and merges the way HF transformers' GGUF conversion does, so token ids agree
with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jaxinfer.errors import ConfigError, ModelLoadError

_META_FILE = "jaxinfer_tokenizer.json"
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# How each GGUF `tokenizer.ggml.pre` splits text before BPE (the regex its merges were learned
# with); anything else gets ByteLevel's own GPT-2 regex, as in HF's conversion.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes map to
    themselves, the rest to code points from 256 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return dict(sorted(table.items()))


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types, pre: str | None):
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is respelled from its UTF-8 bytes.
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(spelled)},
                     merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    split = _PRE_SPLITS.get(pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = (byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]))
    tok.decoder = decoders.ByteLevel()
    types = list(token_types or [])
    # Control tokens outside the byte alphabet are llama.cpp mislabels; HF skips them too.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    return tok


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

    # --- constructors -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        from checkpoints.gguf_loader import meta, open_gguf

        reader = open_gguf(reader_or_path) if isinstance(reader_or_path, (str, Path)) else reader_or_path
        model = meta(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer model {model!r} is not supported; only "
                                 f"byte-level BPE ('gpt2') is")
        backend = _byte_level_bpe(meta(reader, "tokenizer.ggml.tokens"),
                                  meta(reader, "tokenizer.ggml.merges") or [],
                                  meta(reader, "tokenizer.ggml.token_type"),
                                  meta(reader, "tokenizer.ggml.pre"))
        bos = meta(reader, "tokenizer.ggml.bos_token_id")
        if meta(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
            bos_tok = backend.id_to_token(bos)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A $B", special_tokens=[(bos_tok, bos)])
        eos = [meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(backend, bos_token_id=bos,
                   eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
                   chat_template=meta(reader, "tokenizer.chat_template"))

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to
        their ids. `add_special_tokens` adds a BOS only where the model's tokenizer does."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

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
