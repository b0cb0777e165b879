"""``verl-ppo reward-server``: serve any reward model over HTTP.

Run::

    verl-ppo reward-server --model minilm --port 8000            # loopback only
    verl-ppo reward-server --model rule --host 0.0.0.0 --port 8000  # reachable by others

Protocol (JSON over HTTP/1.1, keep-alive):

* ``POST /score`` body: a :class:`~verl_ppo.reward.base.RewardBatch` in JSON
  (``prompt_ids``, ``response_ids``, ``prompts``, ``responses``, ``entries``: B items
  each). Answer 200: ``{"rewards": [float] * B, "latency_s": float}``.
  400: malformed request, ``{"error": "..."}`` naming the field (an entry the model cannot
  read, e.g. without ``metadata.source_dataset``, included); 411: no valid
  ``Content-Length``; 413: body larger than ``max_body_bytes``; 408: the body did not
  arrive within ``idle_timeout_s``; 500: the model itself failed, ``{"error": "..."}``.
* Every other malformed request (a bad request line, HTTP/0.9, over-long headers, an
  unknown method) gets a 4xx answer with a JSON ``{"error": ...}`` body, never an HTML
  page or a traceback; a handler error is one line on stderr.
* ``GET /health``: 200 ``{"status": "ok", "model": name, "batches": n, "samples": n,
  "latency_mean_s": float}``.

Requests are handled on threads (``ThreadingHTTPServer``); calls into the model are
serialised by a lock, since a model's forward on one device gains nothing from
interleaving. There is no authentication: bind to loopback (the default) unless the
network is trusted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from verl_ppo.reward.base import RewardBatch, RewardModel, check_rewards
from verl_ppo.reward.stats import LatencyStats

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RewardServer:
    """An HTTP server around a reward model.

    Args:
        reward_model: what to serve.
        host: interface to bind; loopback by default.
        port: TCP port; 0 picks a free one (read it back from :attr:`port`).
        max_body_bytes: largest accepted request body.
        idle_timeout_s: a kept-alive connection idle this long is closed.

    Use as a context manager (serves on a background thread) or call
    :meth:`serve_forever` in the foreground.
    """

    def __init__(
        self,
        reward_model: RewardModel,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 64 << 20,
        idle_timeout_s: float = 60.0,
    ) -> None:
        self.reward_model = reward_model
        self.max_body_bytes = max_body_bytes
        self.stats = LatencyStats()
        self.samples = 0
        self._score_lock = threading.Lock()
        handler = type("RewardHandler", (_Handler,), {"owner": self, "timeout": idle_timeout_s})
        self.httpd = _QuietServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        """Bound address."""
        return self.httpd.server_address[0]

    @property
    def port(self) -> int:
        """Bound TCP port."""
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        """Base URL for :class:`~verl_ppo.reward.remote.RemoteReward`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        """Name of the served model."""
        return getattr(self.reward_model, "name", type(self.reward_model).__name__)

    def score_json(self, obj: object) -> dict:
        """Score a decoded request body; returns the answer dict.

        Raises:
            ValueError: malformed request (becomes HTTP 400).
            Exception: whatever the model raised (becomes HTTP 500).
        """
        batch = RewardBatch.from_json(obj)
        t0 = time.perf_counter()
        with self._score_lock:
            rewards = check_rewards(self.reward_model.score(batch), len(batch), self.model_name)
            dt = time.perf_counter() - t0
            self.stats.record(dt)
            self.samples += len(batch)
        return {"rewards": rewards.tolist(), "latency_s": dt}

    def health(self) -> dict:
        """The ``GET /health`` answer."""
        vals = self.stats.values()
        return {
            "status": "ok",
            "model": self.model_name,
            "batches": self.stats.count,
            "samples": self.samples,
            "latency_mean_s": sum(vals) / len(vals) if vals else None,
        }

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`shutdown` is called from another."""
        self.httpd.serve_forever(poll_interval=0.1)

    def start(self) -> RewardServer:
        """Serve on a daemon thread; returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="reward-server", daemon=True
        )
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _QuietServer(ThreadingHTTPServer):
    """A client that breaks its connection costs one line on stderr, not a traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            print(f"reward-server: {client_address}: {exc!r}", file=sys.stderr)


class _Handler(BaseHTTPRequestHandler):
    owner: RewardServer
    protocol_version = "HTTP/1.1"
    server_version = "verl-ppo-reward/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per request would drown the trainer's logs

    def _send(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, error: str, headers: dict[str, str] | None = None) -> None:
        """Answer ``status`` with a JSON error and close the connection, first reading what
        the client already sent (closing on unread bytes would reset the connection before
        the client reads the answer)."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # so the answer carries a status line
            self.request_version = "HTTP/1.0"
        self._send(status, {"error": error}, headers)
        self._drain()

    def _drain(self) -> None:
        """Read and drop what the client sent beyond the request handled (the connection
        is closed next)."""
        self.wfile.flush()
        try:
            self.connection.settimeout(0.2)
            while self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """The stdlib's error page as JSON; its 5xx for the client's request (501 unknown
        method, 505 unknown HTTP version) become 405 and 400: the client is at fault."""
        if code == 501:
            self._refuse(
                405,
                f"method {self.command!r} not allowed; use POST /score, GET /health",
                {"Allow": "GET, POST"},
            )
            return
        text = message or self.responses.get(code, ("error",))[0]
        if code == 505:
            code, text = 400, f"{text}; send HTTP/1.1"
        self._refuse(code, text)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.request_version == "HTTP/0.9":
            self.send_error(400, "HTTP/0.9 requests are not served; send HTTP/1.1")
            return False
        return ok

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if not (self.path.rstrip("/").endswith("/health") or self.path in ("/", "")):
            self._refuse(404, f"no such path {self.path!r}; use POST /score, GET /health")
            return
        with_body = self.headers.get("Content-Length", "0").strip() not in ("", "0")
        self.close_connection = self.close_connection or with_body  # a GET body is not read
        self._send(200, self.owner.health())
        if with_body:
            self._drain()

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        if not self.path.rstrip("/").endswith("/score"):
            self._refuse(404, f"no such path {self.path!r}; use POST /score")
            return
        raw = self.headers.get("Content-Length", "")
        try:
            length = int(raw)
        except ValueError:
            self._refuse(411, f"Content-Length header required (a byte count), got {raw!r}")
            return
        if length < 0:
            self._refuse(400, f"Content-Length must be >= 0, got {length}")
            return
        if length > self.owner.max_body_bytes:
            self._refuse(413, f"body of {length} bytes > max {self.owner.max_body_bytes}")
            return
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            self._refuse(408, f"the body of {length} bytes did not arrive within {self.timeout} s")
            return
        if len(body) < length:
            self._refuse(400, f"body ended after {len(body)} of {length} bytes (Content-Length)")
            return
        try:
            obj = json.loads(body)
            answer = self.owner.score_json(obj)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            self._send(400, {"error": f"bad request: {str(exc)[:2000]}"})
            return
        except Exception as exc:
            self._send(500, {"error": f"{self.owner.model_name} failed: {exc!r}"})
            return
        self._send(200, answer)


def _parser() -> argparse.ArgumentParser:
    from verl_ppo.reward.factory import SPECS

    p = argparse.ArgumentParser(
        prog="verl-ppo reward-server", description="Serve a reward model over HTTP (JSON)."
    )
    p.add_argument("--host", default="127.0.0.1", help="interface (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0 = any free one")
    p.add_argument("--model", default="rule", help=f"reward model: {SPECS}")
    p.add_argument("--device", default="cpu", help="torch device of a model reward")
    p.add_argument("--max-length", type=int, default=256, help="tokens per text (model)")
    p.add_argument(
        "--text",
        choices=("answer", "response"),
        default="answer",
        help="similarity reward: embed the extracted answer or the whole response",
    )
    p.add_argument("--cache-entries", type=int, default=0, help="LRU cache size, 0 = off")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads, 0 = default")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-ppo reward-server``; returns the exit code.

    Prints ``reward-server: serving <model> on <url>`` (flushed) once listening, so a
    parent process started with ``--port 0`` can read the port. SIGTERM and Ctrl-C stop
    it cleanly (exit code 0).
    """
    args = _parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from verl_ppo.reward.factory import build_reward_model

    try:
        model = build_reward_model(
            args.model,
            device=args.device,
            max_length=args.max_length,
            text=args.text,
            cache_entries=args.cache_entries,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"reward-server: {exc}", file=sys.stderr)
        return 2
    if args.host not in _LOOPBACK:
        print(
            f"reward-server: warning: binding {args.host} exposes an unauthenticated server "
            "to the network",
            file=sys.stderr,
        )
    try:
        server = RewardServer(model, host=args.host, port=args.port)
    except OSError as exc:
        print(f"reward-server: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2

    def _stop(signum, frame) -> None:
        threading.Thread(target=server.httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    print(f"reward-server: serving {server.model_name} on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
