"""Every terminal error kind in zserve, in one place.

An admitted request ends with exactly one terminal answer: its outputs, or one of the errors below.
Each kind says whether the request *may have run* on a backend. A client may retry automatically
only where the answer proves the request never ran (``may_have_run`` is False *and* the kind is
transient), because inference is not always idempotent for the caller (billing, side effects in a
pipeline) and a blind retry of a request that did run doubles the load exactly when the system is
overloaded.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorKind(enum.StrEnum):
    """Wire names of the terminal error kinds (stable: they travel in messages)."""

    DEADLINE = "DEADLINE"
    OVERLOADED = "OVERLOADED"
    BAD_REQUEST = "BAD_REQUEST"
    TOO_LARGE = "TOO_LARGE"
    UNAVAILABLE = "UNAVAILABLE"
    BACKEND_FAILED = "BACKEND_FAILED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


# Whether a request answered with this kind may have started executing on a backend.
# DEADLINE: a request can miss its deadline after it ran (the reply came too late), so "maybe".
# BACKEND_FAILED: the batch was handed to the executor, so "maybe".
# INTERNAL: we do not know where it failed, so "maybe".
_MAY_HAVE_RUN: dict[ErrorKind, bool] = {
    ErrorKind.DEADLINE: True,
    ErrorKind.OVERLOADED: False,
    ErrorKind.BAD_REQUEST: False,
    ErrorKind.TOO_LARGE: False,
    ErrorKind.UNAVAILABLE: False,
    ErrorKind.BACKEND_FAILED: True,
    ErrorKind.SHUTTING_DOWN: False,
    ErrorKind.CANCELLED: False,
    ErrorKind.INTERNAL: True,
}

# Kinds that a client may retry (with backoff) because the request provably never ran and the
# condition is transient.
_RETRYABLE: frozenset[ErrorKind] = frozenset({ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE})


def may_have_run(kind: ErrorKind) -> bool:
    return _MAY_HAVE_RUN[kind]


def is_retryable(kind: ErrorKind) -> bool:
    return kind in _RETRYABLE


class ZServeError(Exception):
    """Base class of every typed zserve error. ``kind`` is the wire name."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.kind.value)
        self.message = message or self.kind.value

    @property
    def may_have_run(self) -> bool:
        return may_have_run(self.kind)

    @property
    def retryable(self) -> bool:
        return is_retryable(self.kind)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class DeadlineError(ZServeError):
    """The request could not finish within its SLO; it was dropped or its reply came too late."""

    kind = ErrorKind.DEADLINE


class OverloadedError(ZServeError):
    """Admission control refused the request: queue bound or predicted wait exceeded."""

    kind = ErrorKind.OVERLOADED


class BadRequestError(ZServeError):
    """The request is malformed: unknown model, wrong input names, dtypes or shapes, bad message."""

    kind = ErrorKind.BAD_REQUEST


class TooLargeError(ZServeError):
    """The request (or a message) exceeds a configured size limit."""

    kind = ErrorKind.TOO_LARGE


class UnavailableError(ZServeError):
    """No backend can serve the model right now (none registered, or the scheduler is away)."""

    kind = ErrorKind.UNAVAILABLE


class BackendFailedError(ZServeError):
    """The batch holding the request failed on the backend (execution error or backend death)."""

    kind = ErrorKind.BACKEND_FAILED


class ShuttingDownError(ZServeError):
    """The cluster is draining; the request was not (or could no longer be) served."""

    kind = ErrorKind.SHUTTING_DOWN


class CancelledError(ZServeError):
    """The client cancelled the request before it started executing."""

    kind = ErrorKind.CANCELLED


class InternalError(ZServeError):
    """A bug or an unexpected condition inside zserve."""

    kind = ErrorKind.INTERNAL


class ProtocolError(BadRequestError):
    """A wire message failed to decode or validate (wrong kind, arity, types, frames or sizes)."""


class WireVersionError(ProtocolError):
    """A handshake (``transport.messages.HANDSHAKES``) of another wire protocol version whose
    fields differ from this version's: the message names both versions."""


class UnroutableError(UnavailableError):
    """A ROUTER send named a peer identity that is not connected (ROUTER_MANDATORY)."""


ERROR_CLASSES: dict[ErrorKind, type[ZServeError]] = {
    ErrorKind.DEADLINE: DeadlineError,
    ErrorKind.OVERLOADED: OverloadedError,
    ErrorKind.BAD_REQUEST: BadRequestError,
    ErrorKind.TOO_LARGE: TooLargeError,
    ErrorKind.UNAVAILABLE: UnavailableError,
    ErrorKind.BACKEND_FAILED: BackendFailedError,
    ErrorKind.SHUTTING_DOWN: ShuttingDownError,
    ErrorKind.CANCELLED: CancelledError,
    ErrorKind.INTERNAL: InternalError,
}


def error_from_wire(kind: str, message: str) -> ZServeError:
    """Rebuild the typed exception for an error kind received over the wire."""
    try:
        cls = ERROR_CLASSES[ErrorKind(kind)]
    except ValueError:
        return InternalError(f"unknown error kind {kind!r}: {message}")
    return cls(message)


# The most bytes of an error message a frontend sends: a message naming what a request got wrong
# must not outgrow what a client accepts (gRPC puts it in a trailer, which tritonclient bounds
# at 16 KiB).
MAX_ERROR_MESSAGE_BYTES = 1024
_CUT_MARK_ROOM_BYTES = 32  # room for " ... (N more bytes)" within the bound


def bounded_message(message: str) -> str:
    """``message`` as a frontend sends it: valid UTF-8 of at most ``MAX_ERROR_MESSAGE_BYTES``,
    cut with `` ... (N more bytes)`` where longer."""
    if len(message) <= MAX_ERROR_MESSAGE_BYTES and message.isascii():
        return message
    data = message.encode("utf-8", "backslashreplace")  # a lone surrogate is no UTF-8
    if len(data) <= MAX_ERROR_MESSAGE_BYTES:
        return data.decode("utf-8")
    keep = MAX_ERROR_MESSAGE_BYTES - _CUT_MARK_ROOM_BYTES
    # "ignore": a character cut in two is dropped whole.
    return f"{data[:keep].decode('utf-8', 'ignore')} ... ({len(data) - keep} more bytes)"
