"""The offline Python API, in the style of vLLM's `LLM.generate`:

    from jaxinfer import LLM, SamplingParams
    llm = LLM(model="smollm2")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

One model over several processes (hosts): run the same script in every process with
`LLM(..., tensor_parallel=N_DEVICES_OF_ALL, distributed=DistributedConfig(...))`; process 0's
LLM leads the job, and on the others LLM(...) follows it and ends the process.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence, Union

from jaxinfer.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from jaxinfer.config import EngineConfig
from jaxinfer.engine import Engine
from jaxinfer.errors import InvalidRequestError, InvalidTypeError
from jaxinfer.lora import LoRARequest
from jaxinfer.request import RequestOutput, SamplingParams

Prompt = Union[str, list, dict]  # text, chat messages, or {"prompt_token_ids": [...]}


class LLM:
    def __init__(self, model: str = "smollm2", *, engine_config: EngineConfig | None = None,
                 lora_modules=(), distributed=None, **engine_kwargs):
        """lora_modules: (name, PEFT directory) pairs of LoRA adapters to serve from the
        start (needs max_loras > 0).
        distributed: join a job of several processes first (multihost.DistributedConfig:
        coordinator address, number of processes, this process's id; or True to let JAX
        detect them under SLURM, Open MPI and the like). Every process runs the same script
        with tensor_parallel set to the devices of all of them. On process 0 LLM(...)
        returns the engine that leads the job; on the others it loads the model, follows
        process 0's steps and, once process 0's engine is released (its process exits),
        ends this process with SystemExit(0): the lines after LLM(...) run on process 0
        only."""
        cfg = engine_config or EngineConfig()
        if engine_kwargs:
            cfg = cfg.replace(**engine_kwargs)
        if distributed is not None:
            _join_or_follow(model, cfg, distributed)
        self.engine = Engine.from_model(model, cfg, lora_modules)
        if self.engine.config.warmup:     # so that no generate() compiles
            self.engine.warmup(progress=True)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Answer one conversation ([{"role", "content"}, ...]) or a list of them, with the
        model's chat template: `generate` over conversations, as vLLM's `LLM.chat`."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidTypeError("messages must be a conversation (a list of "
                                   "{'role', 'content'} dicts) or a list of them",
                                   field="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        return self.generate(conversations, sampling_params, use_tqdm=use_tqdm)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 lora_request: LoRARequest | str | Sequence | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of `prompts`.

        A prompt is text, a list of chat messages ({"role", "content"}: the chat template is
        applied) or {"prompt_token_ids": [...]}. A request whose engine step failed comes back
        with finish_reason "error" and `error` (the others are unaffected).
        lora_request: the LoRA adapter to answer with (the engine needs max_loras > 0), for
        all prompts or a list of one per prompt (None: the base model): a LoRARequest, loaded
        from its lora_path on first use, or the name of a loaded adapter. priority: one
        per prompt, as vLLM's; the queue takes lower values first (all 0 by default)."""
        prompts = _prompt_list(prompts)
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, (SamplingParams, Mapping)):
            params = [SamplingParams.coerce(params)] * len(prompts)
        elif isinstance(params, (list, tuple)):
            params = [SamplingParams.coerce(p, f"sampling_params[{i}]")
                      for i, p in enumerate(params)]
        else:
            raise InvalidTypeError(f"sampling_params must be a SamplingParams, a dict of its "
                                   f"fields or a list of them, got {type(params).__name__}",
                                   field="sampling_params")
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} "
                                      f"SamplingParams", field="sampling_params")
        if lora_request is not None:
            params = [p if name is None else dataclasses.replace(p, lora=name)
                      for p, name in zip(params, self._lora_names(lora_request, len(prompts)))]
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
            raise InvalidRequestError(f"priority must be a list of one integer per prompt "
                                      f"({len(prompts)})", field="priority")
        ids: list[str] = []
        try:
            for p, sp, rank in zip(prompts, params, priority):
                ids.append(self.engine.add_request(p, sp, priority=rank))
        except Exception:   # one bad prompt: leave nothing of this call queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        try:
            done = self.engine.run_until_done(use_tqdm=use_tqdm)
        except BaseException:   # interrupted, or the engine died: leave nothing queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [done[i] for i in ids]

    def _lora_names(self, lora_request, n: int) -> list[str | None]:
        """lora_request (generate's) as one adapter name (or None) per prompt, loading the
        LoRARequests not loaded yet."""
        many = isinstance(lora_request, (list, tuple))
        items = list(lora_request) if many else [lora_request] * n
        if len(items) != n:
            raise InvalidRequestError(f"got {n} prompts but {len(items)} LoRA requests",
                                      field="lora_request")
        names = []
        for item in items:
            if isinstance(item, LoRARequest):
                if item.lora_name not in self.engine.lora_names() and item.lora_path:
                    self.engine.load_lora(item.lora_name, item.lora_path)
                item = item.lora_name
            if item is not None and not isinstance(item, str):
                raise InvalidTypeError(f"lora_request must be a LoRARequest, an adapter's "
                                       f"name, None or a list of them, got "
                                       f"{type(item).__name__}", field="lora_request")
            names.append(item)
        return names

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The `params.beam_width` best beams of each prompt, best first, as vLLM's
        `LLM.beam_search` (jaxinfer.beam_search): `outputs[i].sequences[j]` has `tokens`
        (prompt and generated), `text` (generated), `cum_logprob`, `logprobs`."""
        return beam_search(self.engine, _prompt_list(prompts), params)


def _join_or_follow(model, cfg: EngineConfig, distributed) -> None:
    """Join the job `distributed` describes; return on process 0, follow on the others."""
    from jaxinfer import multihost
    if distributed is True:
        distributed = multihost.DistributedConfig()
    if not isinstance(distributed, multihost.DistributedConfig):
        raise InvalidTypeError(f"distributed must be a DistributedConfig or True, got "
                               f"{type(distributed).__name__}", field="distributed")
    if not multihost.join(distributed):
        from jaxinfer.follower import follow_model
        raise SystemExit(follow_model(model, cfg))


def _prompt_list(prompts) -> list:
    """One prompt or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)
            and "role" in prompts[0]):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidTypeError(f"prompts must be a prompt or a list of prompts, got "
                               f"{type(prompts).__name__}", field="prompts")
    return list(prompts)
