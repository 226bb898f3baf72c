"""The HTTP API's errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
ApiError, raised for a status of its own, and the response every error becomes."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"),
                                   "param": param, "code": code}}, status_code=status)
