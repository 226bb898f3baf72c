"""Resuming the offline script after a crash: which results the output file already holds
(jaxinfer's ids, OpenAI batch custom_ids), and a tail a crash cut short, cut off."""
from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

from jaxinfer.errors import JaxinferError


@dataclasses.dataclass
class Done:
    """What the output file already holds."""
    ids: set[str] = dataclasses.field(default_factory=set)          # jaxinfer-format results
    custom_ids: set[str] = dataclasses.field(default_factory=set)   # batch results, 400s too
    # 400 results for a repeated custom_id, by custom_id. They are written when the repeat is
    # read, maybe before the first line with that custom_id finishes, so they do not make it
    # done; they answer the input's repeats, in order.
    duplicates: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, raw: bytes) -> bool:
        """Take one output line; False when it is not a result."""
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        if not isinstance(obj, dict):
            return False
        if isinstance(obj.get("custom_id"), str):
            if _error_param(obj) == "custom_id":
                self.duplicates[obj["custom_id"]] += 1
            else:
                self.custom_ids.add(obj["custom_id"])
            return True
        if "id" in obj:
            self.ids.add(str(obj["id"]))
            return True
        return False


def _error_param(obj: dict):
    try:
        return obj["response"]["body"]["error"]["param"]
    except (KeyError, TypeError):
        return None


def load_done(path: Path, log) -> Done:
    """The results already in the output file. A crash can only tear the file's tail (each
    line is written whole, then fsynced), so unreadable lines at the end are cut off; one
    followed by readable lines means the file is not ours, and we stop rather than lose data."""
    done = Done()
    if not path.exists():
        return done
    good_end, torn_at, ends_newline = 0, None, True
    with open(path, "rb") as f:
        offset = 0
        for n, raw in enumerate(f, 1):
            offset += len(raw)
            if not done.add(raw):
                torn_at = torn_at or (n if raw.strip() else None)
                continue
            if torn_at is not None:
                raise JaxinferError(f"{path}: line {torn_at} is not a result, but later lines "
                                    f"are; refusing to append to a file that is not ours")
            good_end, ends_newline = offset, raw.endswith(b"\n")
    if torn_at is None and ends_newline:
        return done
    with open(path, "r+b") as f:
        if torn_at is not None:
            print(f"{path}: dropping line {torn_at} onwards (cut short by a crash)", file=log)
            f.truncate(good_end)
        if not ends_newline:
            f.seek(good_end)
            f.write(b"\n")
    return done
