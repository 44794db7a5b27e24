"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from typing import Optional

from flask import jsonify

from shared.protocol import Failure

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          401: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 501: "server_error", 503: "service_unavailable",
          504: "timeout"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        return jsonify(self.body()), self.status, headers


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: Optional[int] = None) -> ApiError:
    return ApiError(503, message, code="service_unavailable", retry_after=retry_after)


def too_many(message: str, code: str, retry_after: int) -> ApiError:
    return ApiError(429, message, code=code, retry_after=retry_after)


def failure_error(failure: Failure) -> ApiError:
    """A worker's failure of a job (shared/protocol.Failure) as its client's error."""
    return ApiError(504 if failure.code == "timeout" else 500, failure.message, code=failure.code)
