"""The HTTP client of every lit-rlvr component that talks to a server: the reward server (rewards/remote.py), the
code sandbox by URL (rewards/sandbox/remote.py), the LLM judge through the openai client (rewards/judge.py,
`async_client`), the rollout engines' servers (rollout/server.py). One place for the rules
(docs/rewards.md, "HTTP clients"), so no client can forget one:

- http:// and https:// only, and no redirect is followed: a 3xx answer is refused in one line naming both URLs.
  (A reward server answering 302 would otherwise turn the POST into a GET to another host, whose numbers would be
  taken as rewards; a judge's 307 would send prompts, completions and reference answers there.)
- every answer is read in chunks, at most `max_response_bytes` of it: a larger one is refused without being read
  whole (a declared Content-Length over the bound is refused before the first byte).
- every request has one deadline, `timeout_s` from its start, over connecting, sending and reading: a watchdog
  shuts the socket down when it passes. A socket timeout alone bounds each read, and a server that trickles a byte
  at a time would keep the call alive for ever.
- the credentials of a URL never reach a message or a log (`redact`); API keys come from the environment or a file
  (`api_key`), never from a setting that the run's files record.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

import requests
import requests.adapters
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from lit_rlvr.config.errors import HTTPRefusal

DEFAULT_MAX_RESPONSE_BYTES = 16 << 20  # a batch of scores, a judge's token, a program's capped output: far less
SCHEMES = ("http", "https")
_CHUNK = 1 << 16
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")
_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


def redact(text: Any) -> str:
    """`text` with the user and password of every URL in it replaced by `***` (http://***@host/...)."""
    return _USERINFO.sub(r"\1***@", str(text))


def url_problem(url: Any, key: str, example: str) -> Optional[str]:
    """A line when `url` is not an http:// or https:// URL with a host (and a valid port); no network."""
    if not isinstance(url, str) or not url or url == "???":
        shown = "???" if url == "???" else repr(redact(url) if isinstance(url, str) else url)
        return f"{key}={shown} is not valid: expected an http:// or https:// URL (e.g. {example})"
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
        port_ok = True
    except ValueError:
        port_ok = False
    if parts.scheme not in SCHEMES or not parts.hostname or not port_ok:
        return (f"{key}={redact(url)!r} is not valid: expected an http:// or https:// URL with a host (e.g. "
                f"{example}); lit-rlvr speaks no other scheme")
    return None


def start_problem(key: str, url: str, err: Exception) -> str:
    """A start check's line for its request that failed: the setting, the URL (credentials redacted), why."""
    if isinstance(err, HTTPRefusal) and err.kind == "connection":  # its message: "URL: why"
        why = str(err).split(": ", 1)[-1]
        return f"{key}={redact(url)!r}: the server cannot be reached ({why}); start it first, or fix the URL"
    why = str(err) if isinstance(err, HTTPRefusal) else f"{type(err).__name__}: {redact(err)}"
    return f"{key}={redact(url)!r}: the start check's request failed: {why[:400]}"


def api_key(env: Optional[str], file: Optional[str], default: str = "EMPTY") -> str:
    """The API key: the content of `file` (stripped) when one is named, else the environment variable `env`, else
    `default`. Never a setting's value: settings are written to hparams.yaml, the Hydra folder and checkpoints."""
    if file:
        return Path(file).expanduser().read_text().strip()
    return (os.environ.get(env) if env else None) or default


def redirect_refusal(url: str, status: int, location: Optional[str]) -> HTTPRefusal:
    where = urllib.parse.urljoin(url, location) if location else "no Location"
    return HTTPRefusal(f"{redact(url)} answered HTTP {status}, a redirect to {redact(where)}: lit-rlvr follows no "
                       "redirects (give the final URL if it is yours)", "redirect", status)


def size_refusal(url: str, cap: int, key: str) -> HTTPRefusal:
    return HTTPRefusal(f"{redact(url)} answered more than {cap} bytes ({key}={cap}); the answer was not read",
                       "size")


def status_refusal(url: str, status: int, reason: str, said: bytes = b"") -> HTTPRefusal:
    why = " (the server refuses the credentials)" if status in (401, 403) else ""
    text = redact(said.decode("utf-8", "replace")).strip()  # the start of its error body: what the server said
    return HTTPRefusal(f"{redact(url)} answered HTTP {status} {reason}{why}".rstrip() + (f": {text!r}" if text else ""),
                       "status", status)


# ---------------------------------------------------------------------------------------------------------------
# The deadline: a watchdog that shuts down the sockets of the request this thread is making


class _Deadline:
    """Shuts down every socket attached to it when `seconds` have passed (a blocked read then returns at once)."""

    def __init__(self, seconds: float):
        self.seconds, self.at, self.passed = seconds, time.monotonic() + seconds, False
        self._sockets: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(self.at - time.monotonic(), 1e-3)

    def attach(self, sock: Any) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.passed:
                _shutdown(sock)

    def _cut(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._sockets:
                _shutdown(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shutdown(sock: Any) -> None:
    try:  # the plain socket's shutdown, also for a TLS socket (whose own would drop its TLS state under a reader)
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


_current = threading.local()  # the deadline of the request this thread is making


class _Watched:
    """A connection that hands its socket to the current request's deadline: a new one as soon as TCP connects
    (the TLS handshake is then under the deadline too), a kept-alive one before it waits for the answer."""

    def _new_conn(self) -> Any:
        sock = super()._new_conn()
        _watch(sock)
        return sock

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        _watch(self.sock)
        return super().getresponse(*args, **kwargs)


def _watch(sock: Any) -> None:
    deadline = getattr(_current, "deadline", None)
    if deadline is not None and sock is not None:
        deadline.attach(sock)


class _WatchedHTTPConnection(_Watched, HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


_POOLS = {"http": _Pool, "https": _TLSPool}


class _Adapter(requests.adapters.HTTPAdapter):
    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, *args: Any, **kwargs: Any) -> Any:
        manager = super().proxy_manager_for(*args, **kwargs)
        manager.pool_classes_by_scheme = _POOLS
        return manager


# ---------------------------------------------------------------------------------------------------------------
# The client (requests)


class HTTPClient:
    """POSTs (and GETs) JSON under the module's rules: `timeout_s` per request as a whole (a call may give its
    own), opening a connection within `connect_timeout_s` of it when given, answers up to `max_response_bytes`
    (`size_key` names the setting in the refusal), `retries` more tries on a dropped connection or a 5xx with
    back-off from `backoff_s` (doubling); a deadline, a redirect, a 4xx or an answer too large is not retried.
    Thread-safe (one session per thread) and picklable (sessions are made where they are used)."""

    def __init__(self, timeout_s: float, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, retries: int = 0,
                 backoff_s: float = 0.5, size_key: str = "max_response_bytes", headers: Optional[dict] = None,
                 connect_timeout_s: Optional[float] = None):
        self.timeout_s, self.max_response_bytes, self.size_key = float(timeout_s), int(max_response_bytes), size_key
        self.retries, self.backoff_s, self.headers = int(retries), float(backoff_s), {**_HEADERS, **(headers or {})}
        self.connect_timeout_s = None if connect_timeout_s is None else float(connect_timeout_s)
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _local=threading.local())

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.mount("http://", _Adapter(max_retries=0))
            session.mount("https://", _Adapter(max_retries=0))
            self._local.session = session
        return session

    def post_json(self, url: str, payload: Any) -> Any:
        """POST `payload` as JSON to `url`; the decoded JSON answer, or an `HTTPRefusal` (or `ValueError`: not JSON)."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload, default=str).encode()
        for attempt in range(self.retries + 1):
            try:
                return json.loads(self.post(url, body))
            except HTTPRefusal as err:
                if not err.retry or attempt == self.retries:
                    raise
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def post(self, url: str, body: Optional[bytes], *, params: Optional[dict] = None,
             timeout_s: Optional[float] = None) -> bytes:
        """One POST of `body` to `url` (`params`: its query): the answer's bytes, or an `HTTPRefusal` naming what
        went wrong. `timeout_s` bounds this request instead of the client's."""
        return self.request("POST", url, body, params=params, timeout_s=timeout_s)

    def get(self, url: str, *, timeout_s: Optional[float] = None) -> bytes:
        """One GET of `url` (see `post`)."""
        return self.request("GET", url, None, timeout_s=timeout_s)

    def request(self, method: str, url: str, body: Optional[bytes], *, params: Optional[dict] = None,
                timeout_s: Optional[float] = None) -> bytes:
        if urllib.parse.urlsplit(url).scheme not in SCHEMES:
            raise HTTPRefusal(f"{redact(url)}: lit-rlvr speaks http:// and https:// only", "scheme")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = _Deadline(limit)
        _current.deadline = deadline
        try:
            connect = deadline.left() if self.connect_timeout_s is None else min(self.connect_timeout_s, limit)
            with self._session().request(method, url, data=body, params=params, headers=self.headers,
                                         allow_redirects=False, stream=True,
                                         timeout=(connect, deadline.left())) as response:
                if 300 <= response.status_code < 400:
                    raise redirect_refusal(url, response.status_code, response.headers.get("Location"))
                if response.status_code >= 400:
                    raise status_refusal(url, response.status_code, response.reason or "", _start(response))
                body = self._read(url, response)
            if deadline.passed:  # a body delimited by the connection's end looks whole when the watchdog cuts it
                raise self._late(url, limit)
            return body
        except (requests.RequestException, OSError) as err:
            if deadline.passed or isinstance(err, requests.Timeout):  # the watchdog's cut, or a socket timeout
                raise self._late(url, limit) from None
            if isinstance(err, requests.exceptions.SSLError):
                raise HTTPRefusal(f"{redact(url)}: the TLS handshake failed (an https:// URL for a plain http "
                                  f"server?): {redact(err)[:200]}", "tls") from None
            raise HTTPRefusal(f"{redact(url)}: {type(err).__name__}: {_reason(err)}", "connection") from None
        finally:
            _current.deadline = None
            deadline.cancel()

    def _late(self, url: str, limit: float) -> HTTPRefusal:
        return HTTPRefusal(f"{redact(url)}: timed out, no whole answer within timeout_s={limit:g}s", "deadline")

    def _read(self, url: str, response: requests.Response) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_response_bytes:
            raise size_refusal(url, self.max_response_bytes, self.size_key)
        body = bytearray()
        for chunk in response.iter_content(_CHUNK):
            body += chunk
            if len(body) > self.max_response_bytes:
                raise size_refusal(url, self.max_response_bytes, self.size_key)
        return bytes(body)


def _start(response: requests.Response, limit: int = 300) -> bytes:
    """The first `limit` bytes of an error answer's body (what the server said), read no further."""
    try:
        return next(response.iter_content(limit), b"")[:limit]
    except (requests.RequestException, OSError):
        return b""


def _reason(err: Exception) -> str:
    """The innermost reason of a requests error, without urllib3's wrapping ("HTTPConnectionPool(...): Max retries
    exceeded ... (Caused by NewConnectionError(...))")."""
    inner = getattr(err.args[0], "reason", err.args[0]) if err.args else err
    text = redact(inner)
    return (text.split("): ", 1)[1] if "): " in text else text)[:300]


# ---------------------------------------------------------------------------------------------------------------
# The openai client's transport (httpx): the same rules


def async_client(timeout_s: float, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 size_key: str = "max_response_bytes") -> Any:
    """An httpx `AsyncClient` for the openai client (`http_client=`): no redirects (a 3xx is an `HTTPRefusal`),
    answers up to `max_response_bytes`, uncompressed, and `timeout_s` per socket operation (the caller bounds the
    whole call: the async reward runner's `asyncio.wait_for`, which cancels it). The httpx flavour is the one the
    installed openai speaks (httpx2 from openai 3 on)."""
    httpx = _httpx_for_openai()

    class CappedTransport(httpx.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.AsyncHTTPTransport()

        async def handle_async_request(self, request: Any) -> Any:
            response = await self.inner.handle_async_request(request)
            url = str(request.url)
            try:
                if 300 <= response.status_code < 400:
                    raise redirect_refusal(url, response.status_code, response.headers.get("location"))
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    raise HTTPRefusal(f"{redact(url)} answered compressed ({response.headers['content-encoding']}) "
                                      "though asked for identity: its size after decoding is unbounded", "size")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_response_bytes:
                    raise size_refusal(url, max_response_bytes, size_key)
                body = bytearray()
                async for chunk in response.stream:
                    body += chunk
                    if len(body) > max_response_bytes:
                        raise size_refusal(url, max_response_bytes, size_key)
            finally:
                await response.stream.aclose()
            return httpx.Response(response.status_code, headers=response.headers, content=bytes(body),
                                  extensions=response.extensions, request=request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    return httpx.AsyncClient(transport=CappedTransport(), follow_redirects=False,
                             timeout=httpx.Timeout(timeout_s), headers={"Accept-Encoding": "identity"})


def _httpx_for_openai() -> Any:
    requires = importlib.metadata.requires("openai") or []
    return importlib.import_module("httpx2" if any(r.startswith("httpx2") for r in requires) else "httpx")
