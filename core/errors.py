"""The one exception tree of SpecGate.

Every error SpecGate raises on purpose derives from :class:`SpecGateError`.
Each subclass carries the HTTP status and the stable machine-readable ``code``
that the gateway puts in its error responses, so the mapping to HTTP/WS
errors lives in exactly one place (the class attributes below).

    SpecGateError
    ├── ConfigError            invalid configuration or request parameters (400)
    │   └── InvalidRequest     malformed request body or messages (400)
    │       ├── RequestTooLarge    over a configured request limit (413)
    │       └── UnsupportedMediaType   a POST body that is not JSON (415)
    ├── Unauthorized           missing or unknown API key (401)
    ├── ForeignOrigin          a web page's request to the keyless loopback default (403)
    ├── ModelError             a model file cannot be used (500 at load time)
    │   ├── ModelFileError     missing, unreadable or not GGUF
    │   └── VocabMismatch      speculator and target do not share a tokenizer
    ├── PromptError            the prompt itself cannot be served (400)
    │   ├── EmptyPrompt
    │   └── PromptTooLong      more tokens than the context holds (names both)
    ├── EngineError            llama.cpp refused an operation (500)
    ├── TurnCancelled          the client left or cancelled; the turn stopped early (499)
    ├── SessionNotFound        unknown session id (404)
    ├── SessionBusy            a turn is already running for the session (409)
    ├── OwnedElsewhere         another live replica owns the session (proxied; 409 when it cannot be)
    ├── QueueFull              the admission queue is full (429)
    ├── SessionLimit           the session cap (per key or in total) is reached (429)
    ├── ShuttingDown           the server is draining for a restart (503)
    ├── OwnerLost              the replica running a proxied turn died mid-answer (503, safe to retry)
    ├── StoreUnavailable       the metadata store (Redis) cannot be reached (503)
    └── FetchError             a model package could not be fetched or verified
"""

from __future__ import annotations


class SpecGateError(Exception):
    """Root of all SpecGate errors; ``status`` and ``code`` feed the HTTP/WS mapping."""

    status: int = 500
    code: str = "internal_error"


class ConfigError(SpecGateError, ValueError):
    status = 400
    code = "invalid_parameter"


class InvalidRequest(ConfigError):
    code = "invalid_request"


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class ForeignOrigin(SpecGateError):
    """A request from a web page (a foreign ``Origin``) or through a name that is not this
    machine's (a foreign ``Host``: DNS rebinding) to a keyless server on loopback."""

    status = 403
    code = "forbidden_origin"


class Unauthorized(SpecGateError):
    status = 401
    code = "invalid_api_key"


class ModelError(SpecGateError):
    status = 500
    code = "model_error"


class ModelFileError(ModelError):
    code = "model_file_error"


class VocabMismatch(ModelError):
    code = "vocab_mismatch"


class PromptError(SpecGateError):
    status = 400
    code = "invalid_prompt"


class EmptyPrompt(PromptError):
    code = "empty_prompt"


class PromptTooLong(PromptError):
    code = "context_length_exceeded"

    def __init__(self, n_tokens: int, n_ctx: int, what: str = "prompt") -> None:
        super().__init__(
            f"{what} has {n_tokens} tokens but the context holds {n_ctx}"
        )
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx


class EngineError(SpecGateError):
    status = 500
    code = "engine_error"


class TurnCancelled(SpecGateError):
    status = 499  # nginx's "client closed request": nobody is left to read it
    code = "cancelled"


class SessionNotFound(SpecGateError):
    status = 404
    code = "session_not_found"


class SessionBusy(SpecGateError):
    status = 409
    code = "session_busy"


class OwnedElsewhere(SpecGateError):
    """The message names the session, not the replica (``replica_id``, for the proxy and the log)."""

    status = 409
    code = "session_owned_elsewhere"

    def __init__(self, session_id: str, key: str, replica_id: str) -> None:
        super().__init__(f"session {session_id!r} is served by another replica that could not be reached; "
                         "retry shortly")
        self.key, self.replica_id = key, replica_id


class QueueFull(SpecGateError):
    status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionLimit(SpecGateError):
    status = 429
    code = "too_many_sessions"


class ShuttingDown(SpecGateError):
    status = 503
    code = "shutting_down"


class OwnerLost(SpecGateError):
    """The owner replica stopped answering while a proxied turn ran.  Retrying is safe:
    the client resends the whole conversation, and a turn's record is replaced by that
    conversation plus its new reply, so a turn the dead owner recorded is not doubled."""

    status = 503
    code = "owner_lost"
    retry_after_s = 1


class StoreUnavailable(SpecGateError):
    status = 503
    code = "store_unavailable"


class FetchError(SpecGateError):
    code = "fetch_error"
