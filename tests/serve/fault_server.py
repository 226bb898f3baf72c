"""The server with faults injected into its engine's steps, for tests:

    FAULT_RATE=0.05 FAULT_SEED=1 FAULT_MAX=100 FAULT_RECORD=faults.jsonl \
        python -m fault_server [jaxinfer serve flags]      (with tests/serve on PYTHONPATH)

Each runner.fault_hook call (phases dispatch, dispatched, fetch) raises with probability
FAULT_RATE until FAULT_MAX faults were injected; at "dispatched" half of them first delete
the KV cache (a step that failed after its cache was donated). One in ten calls that do not
fail sleeps FAULT_SLOW_S instead (a slow step). Each fault appends {"phase", "request_ids"}
(the failing step's requests) to FAULT_RECORD. FAULT_PHASES (comma-separated) limits the
phases. With FAULT_DEAD set, faults at "dispatched" always delete the cache and rebuilding
it fails (the engine cannot recover).
"""
import json
import os
import sys
import time

import jax
import numpy as np

from serve import cli


class RandomFaults:
    def __init__(self, engine):
        self.engine = engine
        self.rate = float(os.environ.get("FAULT_RATE", "0"))
        self.max = int(os.environ.get("FAULT_MAX", "100"))
        self.slow_s = float(os.environ.get("FAULT_SLOW_S", "0"))
        self.record = os.environ.get("FAULT_RECORD")
        self.rng = np.random.default_rng(int(os.environ.get("FAULT_SEED", "0")))
        self.phases = os.environ.get("FAULT_PHASES", "dispatch,dispatched,fetch").split(",")
        self.dead = bool(os.environ.get("FAULT_DEAD"))
        self.count = 0
        self.armed = False      # not during the warm-up

    def __call__(self, phase, runner):
        if not self.armed or self.count >= self.max or phase not in self.phases:
            return
        if self.rng.random() >= self.rate:
            if self.slow_s and self.rng.random() < 0.1:
                time.sleep(self.slow_s)
            return
        self.count += 1
        blamed = self.engine._blame
        with open(self.record, "a") as f:
            f.write(json.dumps({"phase": phase, "request_ids": [
                r.request_id for r in blamed.rows] if blamed else None}) + "\n")
        if phase == "dispatched" and (self.dead or self.rng.random() < 0.5):
            for x in jax.tree_util.tree_leaves(runner.kv):
                x.delete()
        raise RuntimeError(f"injected fault {self.count} at {phase}")


def install(engine):
    faults = RandomFaults(engine)
    engine.runner.fault_hook = faults
    if os.environ.get("FAULT_DEAD"):     # recovery fails too: the engine is dead

        def no_memory():
            raise MemoryError("injected: no memory for a new KV cache")

        engine.runner.rebuild_kv = no_memory
    warmup = engine.warmup

    def warmup_then_arm(*a, **kw):
        stats = warmup(*a, **kw)
        faults.armed = True
        return stats

    engine.warmup = warmup_then_arm


if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:], on_engine=install))
