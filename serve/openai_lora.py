"""The HTTP API's LoRA endpoints, vLLM's (a mixin of openai_http.OpenAIApi).

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}   -> 200 text
    POST /v1/unload_lora_adapter  {"lora_name"}                -> 200 text

Both need --allow-runtime-lora (else 404). An adapter is read off the engine's thread and
registered on it, so streams do not wait for the disk.
"""
from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import PlainTextResponse

from jaxinfer import openai_protocol as oai
from jaxinfer.errors import ConfigError, InvalidRequestError
from serve.openai_errors import ApiError


class LoRAEndpoints:
    async def load_lora_adapter(self, request: Request):
        req = oai.parse(oai.LoadLoRAAdapterRequest, await self._runtime_lora(request))
        if req.lora_name == self.model_name:
            raise InvalidRequestError(f"'{req.lora_name}' is the served model's name",
                                      field="lora_name")
        try:        # read off the engine's thread: streams do not wait for the disk
            adapter = await self.admission.off_engine(self._engine.read_lora, req.lora_name,
                                                      req.lora_path)
        except ConfigError as e:
            raise ApiError(400, str(e), param="lora_name") from None
        await self._on_engine(lambda engine: engine.add_lora(adapter))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request):
        req = oai.parse(oai.UnloadLoRAAdapterRequest, await self._runtime_lora(request))
        await self._on_engine(lambda engine: engine.unload_lora(req.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed "
                                 f"successfully.")

    async def _runtime_lora(self, request: Request):
        """The body of a load/unload call, once it is allowed."""
        self.authorize(request)
        if not self.settings.allow_runtime_lora:
            raise ApiError(404, "loading LoRA adapters at run time is off: start the server "
                                "with --allow-runtime-lora", code="not_found")
        self.admission.check()
        return await self.read_json(request)

    async def _on_engine(self, fn):
        """fn(engine) on the engine thread; LoRA off is a 400 naming the setting."""
        try:
            return await asyncio.wrap_future(self.admission.engine.call(fn))
        except ConfigError as e:
            raise ApiError(400, str(e), param="lora_name") from None
