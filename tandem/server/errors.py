"""The errors a client gets: OpenAI's error object `{"error": {message, type, param, code}}`, or Anthropic's
`{"type": "error", "error": {type, message}}` on Anthropic's routes."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client caused (or may retry), sent as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")  # their errors are Anthropic's shape
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an answer with `status`."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def shaped_error(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI error object as the API of route `path` writes its errors (Anthropic's on its routes)."""
    return anthropic_error_body(status, body["error"]["message"]) if path in ANTHROPIC_ROUTES else body
