"""The engine's LoRA adapters (a mixin of Engine: it reads the engine's registry, scheduler
and runner): loading and unloading by name, each request's adapter key, and the adapters
the scheduler gave device slots written to the device before the step that needs them."""
from __future__ import annotations

import dataclasses

from jaxinfer.errors import ConfigError, InvalidRequestError
from jaxinfer.lora import LoRARegistry
from jaxinfer.request import FinishReason
from jaxinfer.scheduler_output import SchedulerOutput


class EngineLoRA:
    def load_lora(self, name: str, path) -> None:
        """Serve the PEFT adapter in directory `path` as `name` (requests name it in
        SamplingParams.lora). InvalidRequestError if it does not fit the model or the
        engine's max_lora_rank; ConfigError if the engine serves none (max_loras 0)."""
        self._lora_registry().load(name, path)

    def read_lora(self, name: str, path):
        """load_lora's reading and checking alone, safe from any thread; `add_lora` on the
        engine's thread then serves it (servers keep the engine's thread off the disk)."""
        return self._lora_registry().read(name, path)

    def add_lora(self, adapter) -> None:
        """Serve an adapter `read_lora` returned."""
        self._lora_registry().add(adapter)

    def unload_lora(self, name: str) -> None:
        """Stop serving `name`; requests already queued with it finish with it."""
        self._lora_registry().unload(name)

    def lora_names(self) -> list[str]:
        """The loaded adapters' names, in load order (safe from any thread)."""
        return [] if self.loras is None else self.loras.names

    def lora_path(self, name: str) -> str:
        """The directory adapter `name` was loaded from."""
        return self._lora_registry().path_of(name)

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ConfigError("this engine serves no LoRA adapters: build it with max_loras "
                              "> 0 (--max-loras)")
        return self.loras

    def _lora_key(self, name: str | None) -> str | None:
        if name is None:
            return None
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (max_loras is 0)",
                                      field="lora")
        return self.loras.key_of(name)

    def _warm_lora_slots(self) -> None:
        """Compile the program that writes a slot, by writing slot 0 with what it holds."""
        key = self.scheduler.lora_slots.key_at(0)
        self.runner.set_lora_slot(0, None if key is None else self.loras.weights(key))

    def _load_lora_slots(self, out: SchedulerOutput) -> SchedulerOutput:
        """The adapters the scheduler gave slots since the last step, onto the device.
        One whose weights cannot be read (out of host memory, and its directory gone) fails
        its requests alone: they come back with FinishReason.ERROR and leave `out`."""
        failed = False
        for slot, key in self.scheduler.lora_slots.take_loads():
            try:
                adapter = self.loras.weights(key)
            except InvalidRequestError as e:
                for req in [r for r in self.scheduler.running if r.lora == key]:
                    self.scheduler.finish(req.request_id, FinishReason.ERROR)
                    self._groups.emit(self._outputs, self._error_output(req, e), self._deltas)
                self.scheduler.lora_slots.forget(key)
                failed = True
                continue
            self.runner.set_lora_slot(slot, adapter)
        if not failed:
            return out
        live = self.scheduler.requests
        return dataclasses.replace(out, rows=tuple(r for r in out.rows
                                                   if r.request_id in live))
