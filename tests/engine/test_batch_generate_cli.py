"""`jaxinfer generate` end to end with the real model (SmolLM2): text prompts and chat messages
in, one result line each out, the summary on stdout. A file apart from test_batch_generate's
tiny-model tests: this one compiles as the SmolLM2 server files do (tests/conftest.py,
OPTIMIZED_FILES), whose engine it runs, those as the other tiny-model files do."""
import json
import os
import subprocess
import sys
from pathlib import Path

from engine_util import read_jsonl, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_cli_text_prompts_end_to_end(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"prompt": "The capital of France is", "id": "fr"},
                      {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}])
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(inp),
           "--output", str(out), "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--max-model-len", "256", "--max-tokens", "5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["id"]: r for r in read_jsonl(out)}
    assert set(results) == {"fr", "line-2"}
    fr, chat = results["fr"], results["line-2"]
    assert fr["prompt"] == "The capital of France is" and "prompt" not in chat
    assert 1 <= fr["completion_tokens"] <= 5 and 1 <= chat["completion_tokens"] <= 3
    assert fr["text"].strip() and isinstance(chat["text"], str)
    assert json.loads(proc.stdout)["requests"] == 2
