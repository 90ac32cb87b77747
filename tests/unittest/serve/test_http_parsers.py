"""uvicorn's HTTP parser and event loop under ``trtllm-glm serve`` (`server.choose_http_loop`): httptools and uvloop
when installed (the serve extra installs them), h11 and asyncio when not or when asked for; and malformed HTTP
refused alike by both parsers (a 4xx, the server still serving), over real sockets on 127.0.0.1."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve_helpers import MODEL
from trtllm_glm.serve.app import build_app
from trtllm_glm.serve.server import MAX_HEAD_BYTES, choose_http_loop, make_server

pytestmark = pytest.mark.cpu_only

HOST = "127.0.0.1"


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


HAVE_C = _imports("httptools") and _imports("uvloop")  # as the server decides (`choose_http_loop`)
# CI installs the serve extra and sets TRTLLM_GLM_REQUIRE_SERVE=1 (tests/conftest.py): there the C pair's tests run
# (and fail) without it rather than being skipped.
C_REQUIRED = os.environ.get("TRTLLM_GLM_REQUIRE_SERVE") == "1"
needs_c = pytest.mark.skipif(not HAVE_C and not C_REQUIRED, reason="httptools / uvloop not installed")
# (http, loop) asked for; the C pair only where installed.
PAIRS = [
    pytest.param(("auto", "auto"), id="httptools-uvloop", marks=needs_c),
    pytest.param(("h11", "asyncio"), id="h11"),
]


class Served:
    """A `make_server` server of the app on a free loopback port, on a thread (``stop`` ends it)."""

    def __init__(self, engine: Any, http: str, loop: str) -> None:
        app = build_app(engine, served_model_name=MODEL, manage_engine=False)
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.server = make_server(app, host=HOST, port=self.port, log_level="critical", http=http, loop=loop)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-parser-test", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module", params=PAIRS)
def served(request: Any, engine: Any) -> Iterator[Served]:
    srv = Served(engine, *request.param)
    yield srv
    srv.stop()


def exchange(port: int, data: bytes, piece: int | None = None, refused: bool = False, timeout: float = 10.0) -> bytes:
    """Send ``data`` (in ``piece``-byte writes when given; ``refused``: stop writing once the server answers or
    closes) and read until the server closes the connection or goes quiet; what came back."""
    s = socket.create_connection((HOST, port))
    s.settimeout(timeout)
    out = b""
    try:
        for i in range(0, len(data), piece or len(data)):
            if refused and select.select([s], [], [], 0)[0]:
                break  # answered (or closed) before the request was over
            try:
                s.sendall(data[i : i + (piece or len(data))])
            except (BrokenPipeError, ConnectionResetError):
                break
            if piece:
                time.sleep(0.002)  # separate reads on the server
        quiet = timeout
        while True:
            s.settimeout(quiet)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
            quiet = 0.5  # the answer has begun: what follows comes at once
    finally:
        s.close()
    return out


def status(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1.1 "), raw[:200]
    return int(raw[9:12])


def request(head: str, body: bytes = b"", **headers: str) -> bytes:
    """``head`` (the request line) with ``Host`` and ``Connection: close`` unless given, then ``headers``."""
    hs = {"Host": "x", "Connection": "close", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return (head + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs.items() if v is not None) + "\r\n").encode() + body


BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
CHUNKED_HEAD = request("POST /v1/completions HTTP/1.1", Connection=None, Content_Type="application/json",
                       Transfer_Encoding="chunked")  # fmt: skip
BIG = "a" * 100_000
BIG_BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "user": BIG * 2}).encode()
INVALID = b"Invalid HTTP request received."  # uvicorn's answer to a request its parser refuses, with either parser

# (bytes, write size or None for one write, expected status, body must contain). Both parsers answer each alike.
REFUSED = {
    "garbage request line": (b"GARBAGE\r\n\r\n", None, 400, INVALID),
    "space in the method": (b"GE T /health HTTP/1.1\r\nHost: x\r\n\r\n", None, 400, INVALID),
    "control byte in the target": (b"GET /he\x01alth HTTP/1.1\r\nHost: x\r\n\r\n", None, 400, INVALID),
    "non-ASCII target": (b"GET /h\xc3\xa9alth HTTP/1.1\r\nHost: x\r\n\r\n", None, 400, INVALID),
    "no version (HTTP/0.9)": (b"GET /health\r\n\r\n", None, 400, INVALID),
    "header without a colon": (b"GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", None, 400, INVALID),
    "space before the colon": (b"GET /health HTTP/1.1\r\nHost: x\r\nFoo : b\r\n\r\n", None, 400, INVALID),
    "bad header-name byte": (b"GET /health HTTP/1.1\r\nHost: x\r\nFo(o: b\r\n\r\n", None, 400, INVALID),
    "NUL in a header value": (b"GET /health HTTP/1.1\r\nHost: x\r\nFoo: b\x00r\r\n\r\n", None, 400, INVALID),
    "HTTP/1.1 without Host": (request("GET /health HTTP/1.1", Host=None), None, 400, INVALID),
    "two Host headers": (b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", None, 400, INVALID),
    "Content-Length not a number": (request("POST /v1/completions HTTP/1.1", Content_Length="abc"), None, 400, INVALID),
    "Content-Length negative": (request("POST /v1/completions HTTP/1.1", Content_Length="-5"), None, 400, INVALID),
    "Content-Length overflows": (request("POST /v1/completions HTTP/1.1", Content_Length="9" * 30), None, 400, INVALID),
    "two Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        None, 400, INVALID,
    ),
    "unknown Transfer-Encoding": (request("POST /v1/completions HTTP/1.1", Transfer_Encoding="gzip"), None, 400,
                                  INVALID),
    "chunked twice": (request("POST /v1/completions HTTP/1.1", Transfer_Encoding="chunked, chunked"), None, 400,
                      INVALID),
    "chunk size not hex": (CHUNKED_HEAD + b"zz\r\nhello\r\n0\r\n\r\n", None, 400, INVALID),
    "chunk without its CRLF": (CHUNKED_HEAD + b"5\r\nhelloXX0\r\n\r\n", None, 400, INVALID),
    # Heads past 16 KiB still incomplete after a read (h11's "Receive buffer too long"; llhttp has no limit).
    "100 KB header, 1 KB writes": (request("GET /health HTTP/1.1", X_Big=BIG), 1000, 400, INVALID),
    "100 KB target, 4 KB writes": (request(f"GET /health?{BIG} HTTP/1.1"), 4096, 400, INVALID),
    "2,000 headers, 1 KB writes": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(2000)) + b"\r\n",
        1000, 400, INVALID,
    ),
    "1 MB header, one write": (request("GET /health HTTP/1.1", X_Big="a" * (1 << 20)), None, 400, INVALID),
    "100 KB trailer, 4 KB writes": (
        CHUNKED_HEAD + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nX-T: " + BIG.encode() + b"\r\n\r\n",
        4096, 400, INVALID,
    ),
    "100 KB chunk extension, 4 KB writes": (
        CHUNKED_HEAD + b"%x;e=" % len(BODY) + BIG.encode() + b"\r\n" + BODY + b"\r\n0\r\n\r\n", 4096, 400, INVALID,
    ),
    # The app's own refusal (the parsers agree on the request).
    "body not JSON": (
        request("POST /v1/completions HTTP/1.1", b"{nope", Content_Type="application/json", Content_Length="5"),
        None, 400, b"not valid JSON",
    ),
}  # fmt: skip
# Refused by both, with a different 4xx: h11 passes these request lines to the app (404 / 405), llhttp refuses them.
REFUSED_4XX = {
    "unknown method": b"FOO /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "CONNECT": b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
}
# Taken by both.
TAKEN = {
    "HTTP/1.0 without Host": (b"GET /health HTTP/1.0\r\n\r\n", None),
    "15 KB header, one write": (request("GET /health HTTP/1.1", X_Big="a" * 15_000), None),
    "15 KB header, 1 KB writes": (request("GET /health HTTP/1.1", X_Big="a" * 15_000), 1000),
    "two 10 KB heads on one connection": (
        request("GET /health HTTP/1.1", X_Big="a" * 10_000, Connection="keep-alive")
        + request("GET /health HTTP/1.1", X_Big="a" * 10_000),
        1000,
    ),
    "200 KB body, 8 KB writes": (
        request("POST /v1/completions HTTP/1.1", BIG_BODY, Content_Type="application/json",
                Content_Length=str(len(BIG_BODY))),
        8192,
    ),
    "chunked body": (CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
                     + b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n", None),
    "Expect: 100-continue": (
        request("POST /v1/completions HTTP/1.1", BODY, Content_Type="application/json",
                Content_Length=str(len(BODY)), Expect="100-continue"),
        None,
    ),
}  # fmt: skip


def test_auto_prefers_httptools_and_uvloop(monkeypatch) -> None:
    assert choose_http_loop("h11", "asyncio") == ("h11", "asyncio")
    if HAVE_C or C_REQUIRED:
        assert choose_http_loop() == ("httptools", "uvloop")
        assert choose_http_loop("h11") == ("h11", "uvloop")
        assert choose_http_loop("httptools", "asyncio") == ("httptools", "asyncio")
    monkeypatch.setitem(sys.modules, "httptools", None)  # as if not installed: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert choose_http_loop() == ("h11", "asyncio")
    with pytest.raises(ValueError, match="httptools is not installed"):
        choose_http_loop("httptools")
    with pytest.raises(ValueError, match="uvloop is not installed"):
        choose_http_loop("auto", "uvloop")
    with pytest.raises(ValueError, match="http must be one of auto, httptools, h11"):
        choose_http_loop("zttp")
    with pytest.raises(ValueError, match="loop must be one of"):
        choose_http_loop("auto", "trio")


def running(server: Any) -> tuple[str, str]:
    """The uvicorn protocol module (``httptools_impl`` or ``h11_impl``) of the server's open connection, and the
    top-level module of the event loop it runs on (``uvloop`` or ``asyncio``)."""
    (conn,) = server.server_state.connections
    impl = next(c.__module__ for c in type(conn).__mro__ if c.__module__.startswith("uvicorn.protocols.http."))
    return impl.rsplit(".", 1)[1], type(conn.loop).__module__.split(".")[0]


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        pytest.param(("auto", "auto"), ("httptools_impl", "uvloop"), id="auto", marks=needs_c),
        pytest.param(("h11", "asyncio"), ("h11_impl", "asyncio"), id="forced-h11-asyncio"),
        pytest.param(("missing", "missing"), ("h11_impl", "asyncio"), id="auto-without-httptools-uvloop"),
    ],
)
def test_the_server_runs_the_chosen_parser_and_loop(asked, expected, engine, monkeypatch, caplog) -> None:
    """The connection's protocol and the loop it runs on, and the start-up line that says so."""
    if asked == ("missing", "missing"):
        monkeypatch.setitem(sys.modules, "httptools", None)
        monkeypatch.setitem(sys.modules, "uvloop", None)
        asked = ("auto", "auto")
    with caplog.at_level(logging.INFO, logger="trtllm_glm.serve"):
        srv = Served(engine, *asked)
    try:
        assert srv.server.http_loop == (expected[0].removesuffix("_impl"), expected[1])
        line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HTTP: uvicorn")]
        assert len(line) == 1, caplog.text
        assert f"parser {srv.server.http_loop[0]}" in line[0] and f"event loop {srv.server.http_loop[1]}" in line[0]
        h11 = f"parser h11 {md.version('h11')}"
        if sys.modules.get("httptools", 0) is None:
            assert f"{h11} (httptools not installed), event loop asyncio (uvloop not installed)" in line[0], line[0]
        elif asked == ("h11", "asyncio"):
            assert f"{h11} (asked for), event loop asyncio (asked for)" in line[0], line[0]
        else:
            want = f"parser httptools {md.version('httptools')}, event loop uvloop {md.version('uvloop')}"
            assert line[0].endswith(want), line[0]
        with socket.create_connection((HOST, srv.port)) as s:
            s.sendall(request("GET /health HTTP/1.1", Connection="keep-alive"))
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
            assert running(srv.server) == expected
    finally:
        srv.stop()


def test_the_head_bound_is_h11s() -> None:
    h11 = pytest.importorskip("h11")
    assert MAX_HEAD_BYTES == h11._connection.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE


@pytest.mark.parametrize("case", list(REFUSED))
def test_malformed_requests_are_refused_alike(served: Served, case: str) -> None:
    data, piece, code, says = REFUSED[case]
    raw = exchange(served.port, data, piece, refused=True)
    assert status(raw) == code and says in raw, raw[:300]
    assert status(exchange(served.port, request("GET /health HTTP/1.1"))) == 200  # still serving


@pytest.mark.parametrize("case", list(REFUSED_4XX))
def test_request_lines_refused_with_a_4xx(served: Served, case: str) -> None:
    assert 400 <= status(exchange(served.port, REFUSED_4XX[case], refused=True)) < 500
    assert status(exchange(served.port, request("GET /health HTTP/1.1"))) == 200


@pytest.mark.parametrize("case", list(TAKEN))
def test_well_formed_edge_requests_are_taken(served: Served, case: str) -> None:
    data, piece = TAKEN[case]
    raw = exchange(served.port, data, piece)
    if case.startswith("Expect"):
        assert raw.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), raw[:200]
        raw = raw[len(b"HTTP/1.1 100 Continue\r\n\r\n") :]
    assert status(raw) == 200, raw[:300]
    if case.startswith("two"):
        assert raw.count(b"HTTP/1.1 200 OK") == 2, raw


def test_still_generates_after_the_hostile_requests(served: Served) -> None:
    raw = exchange(served.port, request("POST /v1/completions HTTP/1.1", BODY, Content_Type="application/json",
                                        Content_Length=str(len(BODY))))  # fmt: skip
    assert status(raw) == 200
    assert json.loads(raw.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2
