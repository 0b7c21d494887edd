"""``deployments.local.client`` against a real HTTP server on 127.0.0.1: every answer counts."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.local import client

# path -> (status, content type, body)
ANSWERS = {
    # What uvicorn sends when Ray Serve's proxy ends a request whose replica died.
    "/plain500": (500, "text/plain; charset=utf-8", b"Internal Server Error"),
    "/json409": (409, "application/json", b'{"state": "disagree"}'),
    "/json200": (200, "application/json", b'{"state": "agree"}'),
    "/empty503": (503, "application/json", b""),
    "/list200": (200, "application/json", b"[1, 2]"),
    "/html200": (200, "text/html", b"<html>hi</html>"),
    "/dying/kv-spec?refresh=true": (500, "text/plain", b"Internal Server Error"),
    "/dying/kv-spec": (500, "text/plain", b"Internal Server Error"),
}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, ctype, body = ANSWERS[self.path]
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_json_answers_come_back_with_their_status(base: str) -> None:
    assert client.http_json(f"{base}/json200") == (200, {"state": "agree"})
    assert client.http_json(f"{base}/json409") == (409, {"state": "disagree"})
    assert client.http_json(f"{base}/empty503") == (503, {})
    assert client.http_json(f"{base}/list200") == (200, {"body": [1, 2]})


@pytest.mark.parametrize("path,status", [("/plain500", 500), ("/html200", 200)])
def test_a_non_json_body_is_an_error_answer_naming_it(base: str, path: str,
                                                      status: int) -> None:
    code, body = client.http_json(f"{base}{path}")
    assert code == status
    assert body["error"]["type"] == "non_json_response"
    assert body["error"]["code"] == status
    assert ANSWERS[path][2].decode() in body["error"]["message"]


def test_wait_for_verdict_polls_through_non_json_answers(base: str) -> None:
    with pytest.raises(TimeoutError, match="non-JSON body"):
        client.wait_for_verdict(f"{base}/dying", timeout_s=0.5)


def _status(url: str) -> int:
    import argparse

    from deployments.cli import status

    parser = argparse.ArgumentParser()
    status.add_arguments(parser)
    return status.main(parser.parse_args(["--url", url]))


def test_status_names_a_non_json_answer_and_exits_incomplete(
        base: str, capsys: pytest.CaptureFixture[str]) -> None:
    from deployments.cli.status import EXIT_INCOMPLETE

    assert _status(f"{base}/dying") == EXIT_INCOMPLETE
    err = capsys.readouterr().err
    assert "not a KV-spec report" in err and "Internal Server Error" in err


def test_status_names_an_unreachable_url_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from deployments.cli.status import EXIT_INCOMPLETE

    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert _status(f"http://127.0.0.1:{port}/v1") == EXIT_INCOMPLETE
    assert "cannot read" in capsys.readouterr().err
