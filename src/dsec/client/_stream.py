"""The events of an exec stream (``POST .../exec/stream``, server-sent events): decoded line
by line, each mapped to an output chunk, the result or the error it carries."""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsec import errors
from dsec import models as wire
from dsec.client._base import wire_error


@dataclass(frozen=True, slots=True)
class SSEEvent:
    event: str
    data: str


class SSEDecoder:
    """Incremental server-sent-events decoder: feed it lines (without their newline)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> SSEEvent | None:
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        return None

    def flush(self) -> SSEEvent | None:
        if not self._data and not self._event:
            return None
        event = SSEEvent(self._event or "message", "\n".join(self._data))
        self._event, self._data = "", []
        return event


ExecEvent = tuple[str, str | wire.ExecResult]


def exec_event(event: SSEEvent) -> ExecEvent | None:
    """Map one SSE event of ``exec/stream`` to ``(kind, chunk | ExecResult)``; ``None`` to skip it."""
    try:
        if event.event in ("stdout", "stderr"):
            chunk = json.loads(event.data)
            if not isinstance(chunk, str):
                raise ValueError(f"{event.event} data must be a JSON string")
            return event.event, chunk
        if event.event == "result":
            return "result", wire.ExecResult.model_validate_json(event.data)
        if event.event == "error":
            body = json.loads(event.data)
            raise wire_error(body.get("error", body) if isinstance(body, dict) else body)
    except errors.DsecError:
        raise
    except ValueError as exc:
        raise errors.InternalError(f"malformed {event.event!r} event from dsec: {exc}") from exc
    return None


def stream_ended_early() -> errors.DsecError:
    return errors.Unavailable("the exec stream ended before its result; the connection was lost")
