"""What the sync and async clients share: the request, the call (a request and how to read
its answer), configuration, where and how often a request is sent (failover between
apiservers, retries), and how errors are read.

The operations themselves are in `_calls` (one function per API call, returning a
:class:`Call`); exec streams' events in `_stream`; the fast path in `_wire`. Here too: the
local side of uploads and downloads (a tar of a local path; extraction by `_extract`).
:class:`Client` and :class:`AsyncClient` only differ in how they send a request (and sleep
between retries).
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Generic, Self, TypeVar

import httpx

from dsec import errors
from dsec.client import _extract, config
from dsec.client._wire import Endpoint

T = TypeVar("T")

BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
EXEC_TIMEOUT_MARGIN_S = 30.0  # HTTP read timeout beyond a command's own timeout
MAX_CONNECTIONS = 512
MAX_KEEPALIVE = 128

try:
    _VERSION = metadata.version("dsec")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    _VERSION = "0"
USER_AGENT = f"dsec-python/{_VERSION}"


class EndsOnExit:
    """`with obj:` ends obj on exit by its `_end` (a client or session closes, a sandbox
    stops)."""

    def _end(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()


class AsyncEndsOnExit:
    """`async with obj:` ends obj on exit by its `_end`."""

    async def _end(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._end()


@dataclass(frozen=True, slots=True)
class Request:
    """One API request, independent of the HTTP client that sends it."""

    method: str
    path: str
    params: list[tuple[str, str]] | None = None
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    idempotent: bool = False  # safe to retry on transient errors
    op_timeout: float | None = None  # server-side timeout of the operation (exec, run)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    request: Request
    parse: Callable[[httpx.Response], T]


def wire_error(item: Any, status: int = 500) -> errors.DsecError:
    """The error a wire error object (``{"code", "message", ...}``) carries."""
    return errors.error_from_wire(status, {"error": item} if isinstance(item, dict) else item)


# --------------------------------------------------------------------------- local archives


def tar_local(local_path: str | Path) -> bytes:
    """A tar (in memory) of a local file or directory, named by its basename."""
    src = Path(local_path)
    if not src.exists():
        raise FileNotFoundError(f"local path {src} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(src, arcname=src.resolve().name or ".", recursive=True)
    return buf.getvalue()


def tar_context(local_dir: str | Path) -> bytes:
    """A build context: the tar (in memory) of a local directory's contents, names relative
    to it, links kept as links (the server refuses one that leads out)."""
    src = Path(local_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"build context {src} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for child in sorted(src.iterdir()):
            tf.add(child, arcname=child.name, recursive=True)
    return buf.getvalue()


def build_events(lines: Iterable[str], on_log: Callable[[str], None] | None) -> dict[str, Any] | None:
    """A Dockerfile build's NDJSON events: each log line to `on_log`; the image once the
    result comes (None before it); its error raised."""
    for raw in lines:
        if not raw.strip():
            continue
        event = json.loads(raw)
        if event.get("type") == "log":
            if on_log is not None:
                on_log(str(event.get("line", "")))
        elif event.get("type") == "result":
            return dict(event["image"])
        elif event.get("type") == "error":
            raise errors.error_from_wire(400, event.get("error"))
    return None


def untar_local(data: bytes, local_dir: str | Path) -> None:
    """Extract a downloaded tar into ``local_dir`` with dsec's own member checks, not the
    Python version's ``tarfile`` filters (see ``dsec.client._extract``)."""
    _extract.extract(data, local_dir)


# --------------------------------------------------------------------------- transport


def delivered(exc: httpx.TransportError) -> bool:
    """Whether the request may have reached the server: every transport error but a refused
    or timed-out connection (no byte of the request left this host)."""
    return not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)


def backoff_delay(attempt: int) -> float:
    """Exponential backoff with jitter: ``uniform(d/2, d)``, ``d = min(cap, base * 2**attempt)``."""
    d = min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2**attempt))
    return random.uniform(d / 2, d)


class BaseClient:
    """Configuration and the I/O-free half of sending a :class:`Request`."""

    def __init__(
        self, url: str | Sequence[str] | None, token: str | None, *, timeout: float, retries: int
    ) -> None:
        if retries < 0:
            raise errors.InvalidRequest(f"retries must be >= 0, got {retries}")
        if timeout <= 0:
            raise errors.InvalidRequest(f"timeout must be > 0, got {timeout}")
        joined = ",".join(url) if isinstance(url, list | tuple) else url
        urls, self.token = config.resolve(joined, token)  # type: ignore[arg-type]
        # Several apiservers (`Client(url=[a, b])`, DSEC_URL=a,b): calls go to one; a call
        # that cannot reach it, is cut off or is told it is unavailable moves the client to
        # the next (see _retry_delay for whether that call is sent again).
        self.urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not self.urls:
            raise errors.InvalidRequest("url must name at least one apiserver")
        self.current = 0
        self.timeout = timeout
        self.retries = max(retries, len(self.urls) - 1) if retries else 0

    @property
    def url(self) -> str:
        return self.urls[self.current]

    def failover(self, failed: int) -> bool:
        """Move on from apiserver `failed` (if it is still the current one); whether there is
        another to move to."""
        if len(self.urls) < 2:
            return False
        if self.current == failed:
            self.current = (failed + 1) % len(self.urls)
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"

    def _client_kwargs(self, url: str | None = None) -> dict[str, Any]:
        headers = {"User-Agent": USER_AGENT}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return {
            "base_url": url or self.url,
            "headers": headers,
            "timeout": httpx.Timeout(self.timeout),
            "limits": httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE),
        }

    def _read_timeout(self, req: Request) -> float:
        """A long command must not hit the HTTP read timeout before its own."""
        if req.op_timeout is not None:
            return max(self.timeout, req.op_timeout + EXEC_TIMEOUT_MARGIN_S)
        return self.timeout

    def _wire_call(self, wire: Endpoint, req: Request, request_id: str) -> tuple[bytes, float, float]:
        """Arguments of ``Wire.request`` / ``AsyncWire.request`` (the fast path) for `req`."""
        payload = wire.payload(
            req.method,
            req.path,
            params=req.params,
            json_body=req.json,
            content=req.content,
            headers={**req.headers, "X-Request-ID": request_id},
        )
        return payload, self.timeout, self._read_timeout(req)

    def _build(self, http: httpx.Client | httpx.AsyncClient, req: Request, request_id: str) -> httpx.Request:
        extra: dict[str, Any] = {}
        read = self._read_timeout(req)
        if read > self.timeout:
            extra["timeout"] = httpx.Timeout(self.timeout, read=read)
        return http.build_request(
            req.method,
            req.path,
            params=tuple(req.params) if req.params else None,
            json=req.json,
            content=req.content,
            headers={**req.headers, "X-Request-ID": request_id},
            **extra,
        )

    @staticmethod
    def _request_id() -> str:
        return str(uuid.uuid4())

    def _unreachable(self, exc: Exception, url: str | None = None) -> errors.Unavailable:
        return errors.Unavailable(f"cannot reach dsec at {url or self.url}: {str(exc) or type(exc).__name__}")

    @staticmethod
    def _error(response: httpx.Response) -> errors.DsecError:
        """The error a non-2xx response carries (its body must already be read)."""
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text or response.reason_phrase
        return errors.error_from_wire(response.status_code, body)

    def _retry_delay(
        self, req: Request, err: errors.DsecError, attempt: int, used: int | None = None, *, sent: bool = True
    ) -> float | None:
        """Seconds to wait before sending `req` again, or ``None`` when ``err`` is final.

        `used`: the apiserver the attempt went to. One that could not be reached, cut the
        connection or answered that it is unavailable is left whatever becomes of this call,
        so the next call goes to another. `sent`: whether the request may have reached it. One
        that did not (see `delivered`) goes to each other apiserver at once and is retried as
        an idempotent one is: nothing ran. One that may have is sent again only if it is
        idempotent (or carries an idempotency key)."""
        moved = used is not None and isinstance(err, errors.Unavailable) and self.failover(used)
        if not err.retryable or (sent and not req.idempotent):
            return None
        if moved and attempt < len(self.urls) - 1 and (not sent or self.retries):
            return 0.0
        if attempt >= self.retries:
            return None
        return backoff_delay(attempt)

    def _lost(self, exc: Exception, used: int) -> errors.Unavailable:
        """A connection to apiserver `used` broke after the request went out (a stream cut
        off): the call fails, the next one goes to another apiserver."""
        self.failover(used)
        return self._unreachable(exc, self.urls[used])

    @staticmethod
    def _parse(call: Call[T], response: httpx.Response) -> T:
        try:
            return call.parse(response)
        except errors.DsecError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise errors.InternalError(
                f"unexpected response from dsec to {call.request.method} {call.request.path}: {exc}"
            ) from exc
