"""OpenAI's error object, and the one map from strop's errors to it.

The ``openai`` SDK raises by HTTP status (400 ``BadRequestError``, 401 ``AuthenticationError``, 403
``PermissionDeniedError``, 404 ``NotFoundError``, 409 ``ConflictError``, 422 ``UnprocessableEntityError``, 429
``RateLimitError``, 5xx ``InternalServerError``) and reads ``{"error": {"message", "type", "param", "code"}}`` from the
body into the exception's ``message``, ``type``, ``param`` and ``code``.
"""

from __future__ import annotations

from strop.client.errors import StropClientError
from strop.gateways.common import HTTP_STATUS

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


# conflicts that end by themselves: a job still being created, or still stopping for a pause
RETRYABLE_CONFLICTS = frozenset({"job_validating", "job_pausing"})
RATE_LIMIT_RETRY_AFTER_S = 10  # a full trainer queue frees a place when a job ends: minutes, so wait a while


class OpenAIError(Exception):
    """A request the gateway answers with an error: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """What the SDK's retry loop reads: it retries 409, 429 and 5xx unless told not to (``x-should-retry``), after
        ``retry-after`` seconds when given. A conflict retrying cannot resolve is final; a full trainer is worth a
        retry a little later."""
        if self.status == 409 and self.code not in RETRYABLE_CONFLICTS:
            return {"x-should-retry": "false"}
        if self.status == 429:
            return {"retry-after": str(RATE_LIMIT_RETRY_AFTER_S)}
        return {}


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param=param, code=code)


def not_found(what: str, ident: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(
        f"No such {what}: {ident!r}", 404, param=param, code=f"{what.replace(' ', '_')}_not_found"
    )


def from_strop(exc: StropClientError, param: str | None = None, message: str | None = None) -> OpenAIError:
    """A trainer error as the gateway's answer: its status mapped as the Tinker gateway maps it (a full queue or
    session table, RESOURCE_EXHAUSTED, is 429: the SDK's RateLimitError, which it retries with backoff); ``message``
    replaces the trainer's own (its fields written as the request's)."""
    status = HTTP_STATUS.get(exc.code, 502)
    code = {429: "rate_limit_exceeded", 401: "invalid_api_key"}.get(status, exc.code.lower())
    return OpenAIError(message or exc.details, status, param=param if status == 400 else None, code=code)
