"""Latency budgets: a request may carry a deadline, and one the engine predicts it cannot meet
is refused at once (DeadlineError: the servers answer RESOURCE_EXHAUSTED / HTTP 429) instead
of being admitted to finish late. Requests without a deadline are never refused here and are
scheduled as before.

The prediction rests on a step-time model fitted online (StepTimeModel): each step's wall
seconds as a linear function of its tokens, rows and context tokens (least squares over the
recent steps, coefficients kept >= 0, fitted again without outliers; steps that compiled are
not timed). The engine times its steps from the first request with a deadline on; until the
model has seen enough steps of different sizes it predicts nothing and every request is
admitted. A new request's completion is then estimated
from the queue as it stands (`Deadlines.predict`):

  1. it waits for a row: the requests ahead of it take the rows as they free up, each for
     its expected output length (running requests hold theirs until they reach it); the
     first row free for it frees no later than the rows' mean load, which is what is used;
  2. its prompt is prefilled after the prompt tokens ahead of it (waiting requests of its
     priority or better, running requests' unfinished prefills), at the step budget left
     beside the decode rows; the steps until then carry that prefill and the rows' decode
     tokens, and cost what a step of their mean size costs;
  3. it decodes its expected output, one token a step, plus the step that reads the last
     token back; full steps while requests wait behind it, else steps as large as the
     recent ones (a moving average), or of its decode rows if larger.

With an inter-token latency target (EngineConfig.itl_target_ms), the same model sizes each
step that carries running requests: its token budget is cut to what the model predicts fits
the target with those rows and the last step's context (`Deadlines.step_budget`), so a
burst of long prompts drains over more steps instead of stretching every decode row's step;
a floor of prefill tokens a step keeps the prompts moving when the target cannot be met.

A request's expected output length is its max_tokens, or less once the engine has seen
enough requests finish: the 90th percentile of recent output lengths, if smaller. Later
arrivals of the same priority never pass a request (the queue orders by priority, then
arrival), so only higher-priority arrivals, preemption (the KV pool running out) and
answers longer than expected can make an admitted request late.
"""
from __future__ import annotations

import collections
import math

import numpy as np

from jaxinfer.errors import DeadlineError, InvalidRequestError, InvalidTypeError

_MIN_STEPS = 16          # observations before the model predicts
_MIN_FINISHED = 32       # finished requests before output lengths are estimated from them


def deadline_at(now: float, seconds) -> float | None:
    """The absolute deadline of a request given `seconds` from `now` (None: none)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidTypeError(f"deadline must be a number of seconds or None, got "
                               f"{type(seconds).__name__}", field="deadline")
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidRequestError(f"deadline must be a positive number of seconds, got "
                                  f"{seconds!r}", field="deadline")
    return now + seconds


class StepTimeModel:
    """Seconds per step = c0 + c1 tokens + c2 rows + c3 context tokens (each c >= 0), least
    squares over the last `window` steps, refitted every `refit_every` observations."""

    def __init__(self, window: int = 256, refit_every: int = 32):
        self._obs = np.zeros((window, 5))      # a ring of (1, tokens, rows, context, seconds)
        self._count = 0
        self._refit_every = refit_every
        self.coefs: np.ndarray | None = None

    def set(self, base: float, per_token: float, per_row: float, per_context: float) -> None:
        """Use these coefficients (seconds, seconds per token / row / context token) until
        the next refit."""
        self.coefs = np.array([base, per_token, per_row, per_context], np.float64)

    def observe(self, tokens: int, rows: int, context: int, seconds: float) -> None:
        self._obs[self._count % len(self._obs)] = (1.0, tokens, rows, context, seconds)
        self._count += 1
        if self._count % self._refit_every == 0 and self._count >= _MIN_STEPS:
            self._fit()

    def _fit(self) -> None:
        data = self._obs[:self._count]
        x, y = data[:, :4], data[:, 4]
        if len(np.unique(x[:, 1])) < 2:
            return       # one step size only: nothing to tell tokens from the rest
        coefs = _non_negative_fit(x, y)
        if coefs is None:
            return
        # Once more without the outliers (a step the host stalled: a collection, a page-in)
        residual = np.abs(y - x @ coefs)
        keep = residual <= 3 * max(np.median(residual), 1e-3 * np.median(y))
        if keep.sum() >= _MIN_STEPS and not keep.all():
            coefs = _non_negative_fit(x[keep], y[keep])
        if coefs is not None:
            self.coefs = coefs

    def predict(self, tokens: float, rows: float, context: float) -> float | None:
        """Seconds for a step of this size, or None before the model is fitted."""
        if self.coefs is None:
            return None
        return float(self.coefs @ np.array([1.0, tokens, rows, context]))


def _non_negative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares of y on the columns of x, dropping those whose coefficient goes
    negative and fitting again; None when none is left."""
    active = np.ones(x.shape[1], bool)
    while active.any():
        coefs = np.zeros(x.shape[1])
        coefs[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = active & (coefs < 0)
        if not negative.any():
            return coefs
        active &= ~negative
    return None


class Deadlines:
    """Admission by predicted completion for one engine's scheduler (module docstring)."""

    def __init__(self, scheduler, model: StepTimeModel | None = None,
                 itl_target_s: float = 0.0):
        self.scheduler = scheduler
        self.model = model if model is not None else StepTimeModel()
        self.itl_target_s = itl_target_s
        self._lengths: collections.deque = collections.deque(maxlen=256)
        self._cap: int | None = None    # the 90th percentile of recent output lengths
        self._num_finished = 0
        self._recent_tokens = 0.0       # tokens per step, a moving average
        # Steps are timed once a request with a deadline came, or from the start with an
        # ITL target.
        self.in_use = bool(itl_target_s)
        self._last_context = 0          # the context tokens of the last step timed
        self._summary = None            # _running's, until the running requests change
        self._waiting = None            # _ahead's (priority, sums), updated by `added`

    # --- what the engine tells it -------------------------------------------------------
    def observe_step(self, output, seconds: float) -> None:
        """One step's scheduled rows (SchedulerOutput) and its wall seconds; ignored until a
        request with a deadline has come (no cost to an engine that never sees one)."""
        if not output.rows or not self.in_use:
            return
        tokens = output.num_tokens      # cached: the bucket's choice computed it
        context = tokens + sum(row.start_pos for row in output.rows)
        self.model.observe(tokens, len(output.rows), context, seconds)
        self._last_context = context
        self._recent_tokens += 0.125 * (tokens - self._recent_tokens)

    def finished(self, request) -> None:
        """A request ended (stop or length): its output length informs expected lengths
        (once deadlines are in use; the percentile is taken every 8th)."""
        if not self.in_use:
            return
        self._lengths.append(request.num_output_tokens)
        self._num_finished += 1
        if len(self._lengths) >= _MIN_FINISHED and self._num_finished % 8 == 0:
            self._cap = int(np.percentile(np.array(self._lengths), 90, method="higher"))

    def step_budget(self, budget: int) -> int:
        """The tokens a step may take so that, with the running requests' rows and the last
        step's context, the model predicts it within the ITL target; never fewer than the
        rows plus max(page_size, budget // 16) for prefills, never more than `budget`."""
        coefs = self.model.coefs
        if coefs is None or coefs[1] <= 0:
            return budget
        rows = len(self.scheduler.running)
        spare = self.itl_target_s - coefs[0] - coefs[2] * rows - coefs[3] * self._last_context
        floor = rows + max(self.scheduler.page_size, budget // 16)
        return min(budget, max(floor, int(spare / coefs[1])))

    # --- admission ----------------------------------------------------------------------
    def expected_output(self, request) -> int:
        n = min(request.sampling_params.max_tokens,
                self.scheduler.max_model_len - request.num_prompt_tokens)
        return n if self._cap is None else max(1, min(n, self._cap))

    def check(self, request) -> None:
        """Raise DeadlineError if `request` (not queued yet; its deadline absolute, on the
        scheduler's clock) is predicted to finish after its deadline."""
        if request.deadline is None:
            return
        self.in_use = True
        now = self.scheduler.clock()
        if request.deadline <= now:
            raise DeadlineError("the request's deadline has passed already")
        finish = self.predict(request)
        if finish is not None and finish > request.deadline:
            raise DeadlineError(
                f"the server predicts this request would finish {finish - now:.3f} s from "
                f"now, after its deadline ({request.deadline - now:.3f} s); retry later or "
                f"with a longer deadline")

    def changed(self) -> None:
        """The running or waiting requests changed other than by `add` (a step was
        scheduled, tokens came, a request finished): the summaries are read again."""
        self._summary = self._waiting = None

    def _running(self) -> tuple:
        """(expected remaining output summed over the running requests, decode rows,
        context tokens, unfinished prefill tokens), kept until the running requests change:
        a burst of admissions between two steps reads them once."""
        if self._summary is None:
            remaining, decode, context, prefill = 0, 0, 0, 0
            for r in self.scheduler.running:
                context += r.num_computed_tokens
                left = r.num_uncomputed_tokens
                if left > 1 or r.num_output_tokens == 0:    # still prefilling
                    prefill += left
                else:
                    decode += 1
                remaining += max(1, self.expected_output(r) - r.num_output_tokens)
            self._summary = (remaining, decode, context, prefill)
        return self._summary

    def _ahead(self, priority: int) -> list:
        """[requests, the steps their rows are held (expected output + 1), prompt tokens]
        summed over the waiting requests of `priority` or better; kept for one priority and
        updated as `added` requests join."""
        if self._waiting is None or self._waiting[0] != priority:
            count = hold = tokens = 0
            for r in self.scheduler.waiting:
                if r.priority <= priority:
                    count += 1
                    hold += 1 + self.expected_output(r)
                    tokens += r.num_uncomputed_tokens
            self._waiting = (priority, [count, hold, tokens])
        return self._waiting[1]

    def added(self, request) -> None:
        """`request` joined the waiting queue."""
        if self._waiting is not None and request.priority <= self._waiting[0]:
            ahead = self._waiting[1]
            ahead[0] += 1
            ahead[1] += 1 + self.expected_output(request)
            ahead[2] += request.num_uncomputed_tokens

    def predict(self, request) -> float | None:
        """When `request` would finish if queued now (scheduler clock), or None before the
        step-time model is fitted."""
        sched, model = self.scheduler, self.model
        if model.coefs is None:
            return None
        budget, max_rows = sched.max_num_batched_tokens, sched.max_num_seqs
        if self.itl_target_s:
            budget = self.step_budget(budget)    # what the ITL target leaves a step
        remaining, decode, context, ahead_tokens = self._running()
        num_ahead, hold, tokens = self._ahead(request.priority)
        ahead_tokens += tokens
        behind = len(sched.waiting) - num_ahead
        # 1. a row: the requests ahead take the rows as they free up (a running request's
        # when it has its expected output), each for its expected output; the row that frees
        # first for it does so no later than the rows' mean load
        usable = len(sched.running) + max(0, sched.free_rows)
        own = 1 + len(request.forks)             # n completions take n rows
        row_steps = 0 if num_ahead + own <= sched.free_rows else math.ceil(
            (remaining + hold) / max(1, usable))
        # 2. its prompt, after those ahead, at the budget the decode rows leave; the steps
        # until then carry that prefill and the decode tokens of the rows (their mean size)
        rate = max(1, budget - decode)
        prompt = request.num_uncomputed_tokens
        steps = max(row_steps + math.ceil(prompt / rate),
                    math.ceil((ahead_tokens + prompt) / rate))
        rows = min(max_rows, len(sched.running) + num_ahead + own)
        decoded = min(remaining + hold - num_ahead, rows * steps)
        context += ahead_tokens + prompt
        first = model.predict(min(budget, (ahead_tokens + prompt + decoded) / steps), rows,
                              context)
        # 3. its answer: one token a step, and the step that reads the last one back; steps
        # as full as the recent ones, or full while others wait behind it
        output = self.expected_output(request)
        tokens = budget if behind else min(budget, max(rows, self._recent_tokens))
        after = model.predict(tokens, rows, context + rows * output / 2)
        return sched.clock() + steps * first + output * after
