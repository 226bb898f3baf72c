"""Models named as on the Hugging Face Hub ("org/name"), read from the local Hugging Face
cache only: jaxinfer never downloads weights at run time."""
from __future__ import annotations

import re
from pathlib import Path

from jaxinfer.errors import ModelLoadError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(source: str) -> bool:
    """Whether `source` reads as a Hub id ("org/name") and names no local path."""
    return bool(_REPO_ID.match(source)) and not Path(source).exists()


def cached_snapshot(repo_id: str) -> Path:
    """The local cache's snapshot directory of `repo_id` (config.json, *.safetensors,
    tokenizer.json), or a ModelLoadError that says how to get the files."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"jaxinfer never downloads weights. Fetch it first, e.g. `huggingface-cli "
            f"download {repo_id} --include '*.json' '*.safetensors'`, or pass a local "
            f"directory") from None
