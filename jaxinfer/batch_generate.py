"""Offline batch generation: a JSONL file of requests in, a JSONL file of results out.

    jaxinfer generate --input requests.jsonl --output results.jsonl [engine and sampling flags]

Each input line is a JSON object in one of two formats, told apart line by line:

- jaxinfer's: exactly one of `prompt` (text), `messages` (chat) or `prompt_token_ids`;
  optionally `id` (string or integer; default "line-<N>") and any SamplingParams field, which
  overrides the CLI's sampling flags for that line. Its result: id, prompt (text prompts),
  text, token_ids, finish_reason, prompt_tokens, completion_tokens, ttft_s, latency_s,
  logprobs and prompt_logprobs (when asked for: per token {token id: logprob}, the first
  prompt token's null); with `n` > 1 also `outputs`, one object per completion (index,
  text, token_ids, finish_reason, logprobs), the fields above being the first completion's
  and completion_tokens the sum over all.
- OpenAI's Batch API (a line with `custom_id`), as vLLM's `run-batch` reads it:
  {"custom_id": str, "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
  "body": {...}}. The body is an HTTP server request (jaxinfer.openai_protocol: the same
  fields and checks; no streaming). Its `model` is not checked, and the CLI's sampling flags
  do not apply. Its result: {"id": "batch_req_<hex>", "custom_id", "response": {"status_code":
  200, "request_id", "body": <the text_completion or chat.completion object>}, "error": null};
  a completions body with several prompts gets one response with a choice per prompt.

A line that cannot run (not JSON, unknown field, invalid parameter, empty or too-long prompt,
duplicate id or custom_id) is reported on stderr with its line number; the others still run.
A batch line that cannot run also gets a result with status_code 400 and OpenAI's error
object, whose `param` names the field (`url`, `body.max_tokens`, `custom_id`, ...); one
without a usable custom_id gets none.

A request whose engine step fails (FinishReason.ERROR) is reported on stderr and gets no
result, so a re-run with the same output retries it.

Results are written as each request finishes (a batch line's when all its prompts have). Each
line is appended, flushed and fsynced, so after a crash the file holds every finished result;
re-running with the same output skips the ids and custom_ids already there (400 results
included), and the line a crash cut short is dropped first.

Requests are fed to the Engine gradually (at most `max_queued` unfinished at once), so memory
stays bounded however long the input is. The summary (throughput, TTFT and per-token latency
percentiles, compiles) is returned, and the CLI prints it as JSON on stdout; the exit status
is 1 when some line was rejected.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from jaxinfer import openai_responses as oresp
from jaxinfer.args import engine_config_from_args, sampling_params_from_args
from jaxinfer.batch_resume import Done, load_done
from jaxinfer.engine import Engine
from jaxinfer.errors import InvalidRequestError, JaxinferError
from jaxinfer.openai_batch import (BatchLine, batch_custom_id, batch_record, batch_response,
                                   in_body, parse_batch_line)
from jaxinfer.request import FinishReason, LogprobDicts, RequestOutput, SamplingParams

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_FIELDS = frozenset(SamplingParams.fields())
KNOWN_FIELDS = frozenset(("id",) + PROMPT_FIELDS) | SAMPLING_FIELDS


@dataclasses.dataclass(frozen=True)
class LineRequest:
    id: str | int             # as given (or the default), echoed in the output
    prompt: str | list | dict  # what Engine.add_request takes
    text: str | None          # the text prompt, echoed in the output
    params: SamplingParams

    @property
    def key(self) -> str:
        return str(self.id)


def decode_line(raw: bytes) -> dict:
    """One input line's JSON object; InvalidRequestError when it is not one."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidRequestError("not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"must be a JSON object, got {type(obj).__name__}")
    return obj


def parse_line(obj: dict, line: int, defaults: SamplingParams, chat: bool = False
               ) -> LineRequest:
    """A jaxinfer-format line -> LineRequest; InvalidRequestError names what is wrong."""
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field {', '.join(map(repr, unknown))} (known: "
                                  f"{', '.join(sorted(KNOWN_FIELDS))})", field=unknown[0])
    given = [f for f in PROMPT_FIELDS if f in obj]
    if len(given) != 1:
        raise InvalidRequestError(f"give exactly one of {', '.join(PROMPT_FIELDS)}",
                                  field="prompt")
    rid = obj.get("id", f"line-{line}")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise InvalidRequestError(f"id must be a non-empty string or an integer, got {rid!r}",
                                  field="id")
    prompt, text = _prompt(given[0], obj[given[0]], chat)
    try:
        params = dataclasses.replace(defaults, **{k: obj[k] for k in obj if k in SAMPLING_FIELDS})
    except TypeError as e:  # e.g. "stop": 5 fails before validation can name the field
        raise InvalidRequestError(f"invalid sampling parameter: {e}") from None
    return LineRequest(rid, prompt, text, params)


def _prompt(field: str, value, chat: bool):
    """(prompt for Engine.add_request, echoed text) for the line's one prompt field."""
    expected = {"prompt": str, "messages": list, "prompt_token_ids": list}[field]
    if not isinstance(value, expected):
        raise InvalidRequestError(f"{field} must be a {'string' if expected is str else 'list'}"
                                  f", got {type(value).__name__}", field=field)
    if field == "prompt_token_ids":
        return {"prompt_token_ids": value}, None
    if field == "prompt" and chat and value:
        return [{"role": "user", "content": value}], value
    return value, value if field == "prompt" else None


def result_record(req: LineRequest, out: RequestOutput) -> dict:
    rec = {"id": req.id}
    if req.text is not None:
        rec["prompt"] = req.text
    completions = out.outputs
    rec.update(text=out.text, token_ids=out.token_ids, finish_reason=str(out.finish_reason),
               prompt_tokens=len(out.prompt_token_ids),
               completion_tokens=sum(len(c.token_ids) for c in completions),
               ttft_s=out.ttft_s, latency_s=out.latency_s)
    if out.logprobs is not None:
        rec["logprobs"] = _logprobs_json(out.logprobs)
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = [None if d is None else _logprobs_json([d])[0]
                                  for d in out.prompt_logprobs]
    if len(completions) > 1:     # n > 1: every completion (the fields above are the first's)
        rec["outputs"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                           "finish_reason": c.finish_reason,
                           **({"logprobs": _logprobs_json(c.logprobs),
                               "cumulative_logprob": c.cumulative_logprob}
                              if c.logprobs is not None else {})} for c in completions]
    return rec


def _logprobs_json(logprobs: LogprobDicts) -> list[dict[str, float]]:
    return [{str(t): lp.logprob for t, lp in d.items()} for d in logprobs]


class _BatchRun:
    """The state of one pass over the input: what is queued, what is done, the timings."""

    def __init__(self, engine, lines: Iterator[tuple[int, bytes]], out_file, done: Done,
                 defaults: SamplingParams, chat: bool, max_queued: int, bar, log):
        self.engine, self.lines, self.out_file, self.bar, self.log = (
            engine, lines, out_file, bar, log)
        self.defaults, self.chat, self.max_queued = defaults, chat, max_queued
        self.token_text = oresp.token_text_fn(engine.tokenizer)
        self.done = done
        self.seen: set[str] = set()
        self.seen_custom: set[str] = set()
        # Engine request id (from the line number) -> its line and prompt index.
        self.queued: dict[str, tuple[LineRequest | BatchLine, int]] = {}
        self.exhausted = False
        self.rejected: list[int] = []
        self.skipped = 0
        # Only numbers are kept per finished request, so memory stays small on huge inputs.
        self.num_finished = self.prompt_tokens = self.output_tokens = 0
        self.ttft: list[float] = []
        self.per_token: list[float] = []

    def run(self) -> None:
        while True:
            self.fill()
            if not self.queued:
                while self.engine.has_unfinished_requests():   # a step still in flight
                    self.engine.step(deltas=False)
                return
            for out in self.engine.step(deltas=False):
                if out.finished:
                    self.finished(out)

    def fill(self) -> None:
        """Queue input lines until max_queued requests are unfinished or the input ends."""
        while len(self.queued) < self.max_queued and not self.exhausted:
            item = next(self.lines, None)
            if item is None:
                self.exhausted = True
                return
            try:
                self.add(*item)
            except InvalidRequestError as e:
                self.reject(item[0], f"{e}; skipped")

    def add(self, line: int, raw: bytes) -> None:
        obj = decode_line(raw)
        if "custom_id" in obj:
            self.add_batch(line, obj)
            return
        req = parse_line(obj, line, self.defaults, self.chat)
        if req.key in self.seen:
            raise InvalidRequestError(f"duplicate id {req.id!r} (first seen earlier in the "
                                      f"input)", field="id")
        self.seen.add(req.key)
        if req.key in self.done.ids:
            self.skip()
            return
        rid = f"line-{line}"
        self.engine.add_request(req.prompt, req.params, request_id=rid)
        self.queued[rid] = (req, 0)

    def add_batch(self, line: int, obj: dict) -> None:
        """Queue an OpenAI batch line, or write its 400 result."""
        cid = batch_custom_id(obj)
        try:
            if cid in self.seen_custom:
                if self.done.duplicates[cid]:   # this repeat's 400 result is already written
                    self.done.duplicates[cid] -= 1
                    self.skip()
                    return
                raise InvalidRequestError(f"custom_id: {cid!r} is a duplicate (first seen "
                                          f"earlier in the input)", field="custom_id")
            self.seen_custom.add(cid)
            if cid in self.done.custom_ids:
                self.skip()
                return
            self.submit(line, parse_batch_line(obj, cid, self.engine.config.max_model_len))
        except InvalidRequestError as e:
            self.write(batch_record(cid, 400, None, oresp.invalid_request_body(e)))
            self.reject(line, f"{e}; wrote its 400 result")

    def submit(self, line: int, b: BatchLine) -> None:
        """Add a batch line's prompts to the engine: all of them, or none."""
        b.created = oresp.now()
        rids: list[str] = []
        try:
            for i, prompt in enumerate(b.prompts):
                rid = f"line-{line}.{i}"
                self.engine.add_request(prompt, b.params, request_id=rid)
                rids.append(rid)
        except InvalidRequestError as e:
            for rid in rids:
                self.engine.abort_request(rid)
            field = None
            if e.field in PROMPT_FIELDS:   # the engine names the prompt as it took it
                field = ("messages" if b.chat else
                         f"prompt[{len(rids)}]" if len(b.prompts) > 1 else "prompt")
            raise in_body(e, field) from None
        for i, rid in enumerate(rids):
            self.queued[rid] = (b, i)

    def finished(self, out: RequestOutput) -> None:
        item, index = self.queued.pop(out.request_id)
        if out.finish_reason == FinishReason.ERROR:
            self.failed(out, item)
            return
        self.prompt_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.ttft.append(out.ttft_s)
        if len(out.token_ids) > 1:  # decode time after the first token, per further token
            self.per_token.append((out.latency_s - out.ttft_s) / (len(out.token_ids) - 1))
        if isinstance(item, LineRequest):
            record = result_record(item, out)
        else:
            item.outputs[index] = out
            if len(item.outputs) < len(item.prompts):
                return
            record = batch_response(item, self.engine.model_name, self.token_text)
        self.write(record)
        self.num_finished += 1
        self.bar.update(1)

    def failed(self, out: RequestOutput, item) -> None:
        """The engine step running a request failed: its line gets no result (a re-run with
        the same output retries it); the rest of a batch line's prompts are aborted."""
        for rid in [r for r, (other, _) in self.queued.items() if other is item]:
            del self.queued[rid]
            self.engine.abort_request(rid)
        line = int(out.request_id.split("-", 1)[1].split(".")[0])
        self.reject(line, f"the engine step running it failed ({out.error}); not written, "
                          f"a re-run retries it")

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self.out_file.write(line.encode("utf-8"))
        self.out_file.flush()
        os.fsync(self.out_file.fileno())

    def skip(self) -> None:
        self.skipped += 1
        self.bar.update(1)

    def reject(self, line: int, message: str) -> None:
        self.rejected.append(line)
        self.bar.update(1)
        tqdm.write(f"line {line}: {message}", file=self.log)


def _input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                yield n, raw


def generate_file(engine, input_path, output_path, defaults: SamplingParams | None = None,
                  progress: bool = False, *, chat: bool = False, max_queued: int | None = None,
                  log=None) -> dict:
    """Run every request of the JSONL `input_path` on `engine`, appending results to
    `output_path` (ids and custom_ids already there are skipped). Returns the summary dict."""
    input_path, output_path, log = Path(input_path), Path(output_path), log or sys.stderr
    if not input_path.is_file():
        raise JaxinferError(f"no input file {input_path}")
    if not output_path.parent.is_dir():
        raise JaxinferError(f"no directory {output_path.parent} for the output file")
    done = load_done(output_path, log)
    total = sum(1 for _ in _input_lines(input_path))
    max_queued = max_queued or 4 * engine.config.max_num_seqs
    t0, c0, steps0 = time.perf_counter(), engine.compiles(), engine.num_steps
    spec0 = engine.spec_stats.as_dict() if engine.spec_stats is not None else None
    with open(output_path, "ab") as out_file, tqdm(
            total=total, desc="generating", unit="req", disable=not progress, file=log) as bar:
        run = _BatchRun(engine, _input_lines(input_path), out_file, done,
                        defaults or SamplingParams(), chat, max_queued, bar, log)
        run.run()
    wall = time.perf_counter() - t0
    summary = summarize(run, wall, engine.compiles() - c0, engine.num_steps - steps0)
    if spec0 is not None:     # speculative decoding: drafts, kept tokens, mean accepted length
        summary["speculative"] = engine.spec_stats.since(spec0)
    return summary


def _percentiles(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_p50_s": None, f"{name}_p99_s": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {f"{name}_p50_s": round(float(p50), 6), f"{name}_p99_s": round(float(p99), 6)}


def summarize(run: _BatchRun, wall: float, compiles: int, steps: int) -> dict:
    n, tokens = run.num_finished, run.output_tokens
    return {"requests": n, "skipped_done": run.skipped, "rejected": len(run.rejected),
            "rejected_lines": run.rejected, "prompt_tokens": run.prompt_tokens,
            "output_tokens": tokens, "wall_s": round(wall, 3),
            "requests_per_s": round(n / wall, 3) if wall else None,
            "output_tokens_per_s": round(tokens / wall, 2) if wall else None,
            **_percentiles("ttft", run.ttft), **_percentiles("per_token_latency", run.per_token),
            "steps": steps, "compiles": compiles}


def run_batch_file(args) -> int:
    """`jaxinfer generate --input ... --output ...` (the flags of jaxinfer.args)."""

    if not (args.input and args.output):
        raise JaxinferError("--input and --output go together")
    if args.prompt is not None:
        raise JaxinferError("give a PROMPT or --input/--output, not both")
    if not Path(args.input).is_file():
        raise JaxinferError(f"no input file {args.input}")
    if Path(args.output).resolve() == Path(args.input).resolve():
        raise JaxinferError("--output must not be the --input file")
    defaults = sampling_params_from_args(args)  # before loading: bad flags fail fast
    engine = Engine.from_model(args.model, engine_config_from_args(args), args.lora)
    if engine.config.warmup:
        engine.warmup(progress=True)
    summary = generate_file(engine, args.input, args.output, defaults, progress=True,
                            chat=args.chat)
    print(json.dumps(summary, indent=1))
    return 1 if summary["rejected"] else 0
