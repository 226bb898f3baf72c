"""Speculative decoding with a draft model (EngineConfig.speculative_method "draft"): a smaller
model of the same vocabulary drafts each row's proposal greedily on the device.

It keeps its own K/V pool with the engine's page geometry and reads and writes it at the
engine's own page ids, so it needs no allocator: a request's pages hold the target's K/V in
the engine's pool and the draft's in this one. What the draft's pool holds for a request is
tracked on the host (Request.num_draft_computed, 0 again whenever its pages go); before a
speculative step each row catches up, running its tokens the draft has not seen through the
draft model (prefill chunks, no logits), then the draft program (drafting.draft_tokens, all
the draft's layers) proposes k tokens. Prompt pages served from the prefix cache, or shared
by n > 1 completions, are written again with the same values (same tokens, same positions).
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jaxinfer import batch
from jaxinfer.buckets import Buckets
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.errors import ConfigError
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.runner import ModelRunner
from jaxinfer.scheduler_output import ScheduledRow, SchedulerOutput


def _forward(graphdef, routes, params, kv, tokens, md, kv_sharding=None):
    """The draft model's K/V written for `tokens` (a catch-up chunk); no logits."""
    _, kv = nnx.merge(graphdef, params)(tokens, kv, md, routes)
    if kv_sharding is not None:
        kv = jax.lax.with_sharding_constraint(kv, kv_sharding)
    return kv


class DraftModel:
    def __init__(self, target: ModelConfig, cfg: ModelConfig, engine: EngineConfig, graphdef,
                 params):
        """`cfg`, graphdef, params: the draft model's; engine: the target engine's config
        (its pages, rows and budget)."""
        if cfg.vocab_size != target.vocab_size:
            raise ConfigError(f"speculative_model {cfg.name!r} has a vocabulary of "
                              f"{cfg.vocab_size} tokens; the model's has {target.vocab_size}")
        self.cfg = cfg
        # The runner's draft program over every layer of the draft model (runner.draft).
        self.runner = ModelRunner(cfg, engine.replace(
            speculative_method="self", speculative_draft_layers=cfg.num_layers,
            max_loras=0), graphdef, params)
        self.page_size = engine.page_size
        self.buckets = Buckets(engine.speculative_rows, engine.max_num_batched_tokens,
                               engine.pages_per_seq)
        runner = self.runner
        kv_sharding = None if runner.layout.mesh is None else jax.tree.map(
            lambda x: x.sharding, runner.kv)
        self._forward = jax.jit(functools.partial(_forward, graphdef, runner.routes,
                                                  kv_sharding=kv_sharding),
                                donate_argnums=(1,))

    def catch_up(self, requests, rows) -> None:
        """Run each row's tokens the draft has not seen, before its last (fed by the draft
        program), through the draft model: chunks of at most max_num_batched_tokens."""
        budget = self.buckets.max_num_batched_tokens
        todo = []
        for row in rows:
            req = requests[row.request_id]
            if req.num_draft_computed < row.start_pos:
                todo.append([req, row])
        while todo:
            chunk, left = [], budget
            for req, row in todo:
                if left == 0:
                    break
                have = req.num_draft_computed
                n = min(row.start_pos - have, left)
                chunk.append(ScheduledRow(req.request_id, tuple(req.all_token_ids[have:have + n]),
                                          have, row.page_ids, False))
                req.num_draft_computed = have + n
                left -= n
            out = SchedulerOutput(tuple(chunk))
            self._run(out)
            todo = [(req, row) for req, row in todo if req.num_draft_computed < row.start_pos]

    def _run(self, out: SchedulerOutput) -> None:
        bucket = self.buckets.choose(out.num_tokens, out.num_rows, out.max_pages)
        a = batch.prepare(out, bucket, self.page_size)
        md = AttentionMetadata(a.positions, a.slot_mapping, a.token_seq, a.page_table,
                               a.seq_lens, a.query_start, decode_only=a.decode_only)
        runner = self.runner
        runner.kv = self._forward(runner.params, runner.kv, a.tokens, md)

    def warmup(self, verify_sizes) -> None:
        """Compile the catch-up forward for every bucket (writing nothing) and the draft
        program for every verify size."""
        for b in self.buckets.all_buckets():
            t, rows, w = b.num_tokens, b.num_seqs, b.pages_per_seq
            zeros = np.zeros(t, np.int32)
            md = AttentionMetadata(zeros, np.full(t, -1, np.int32), zeros,
                                   np.zeros((rows, w), np.int32), np.zeros(rows, np.int32),
                                   np.zeros(rows + 1, np.int32), decode_only=b.decode_only)
            self.runner.kv = self._forward(self.runner.params, self.runner.kv, zeros, md)
        self.runner.warmup_drafts(verify_sizes)

    def kv_lost(self) -> bool:
        return self.runner.kv_lost()

    def rebuild_kv(self) -> None:
        self.runner.rebuild_kv()
