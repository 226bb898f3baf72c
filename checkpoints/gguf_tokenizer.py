"""A GGUF file's tokenizer: GGUF carries no tokenizer.json, so the byte-level BPE is rebuilt
from the file's vocabulary and merges the way HF transformers' GGUF conversion does, and token
ids agree with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`."""
from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from checkpoints.gguf_loader import meta, open_gguf
from jaxinfer.errors import ModelLoadError
from jaxinfer.tokenizer import Tokenizer

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


def gguf_tokenizer(reader_or_path) -> Tokenizer:
    """The tokenizer of a GGUF file (a path or an open reader): its special ids and chat
    template included."""
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
    return Tokenizer(backend, bos_token_id=bos,
                     eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
                     chat_template=meta(reader, "tokenizer.chat_template"))

