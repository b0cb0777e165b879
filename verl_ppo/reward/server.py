"""``verl-ppo reward-server``: serve any reward model over HTTP.

Run::

    verl-ppo reward-server --model minilm --port 8000            # loopback only
    verl-ppo reward-server --model rule --host 0.0.0.0 --port 8000  # reachable by others

Protocol (JSON over HTTP/1.1, keep-alive):

* ``POST /score`` body: a :class:`~verl_ppo.reward.base.RewardBatch` in JSON
  (``prompt_ids``, ``response_ids``, ``prompts``, ``responses``, ``entries``: B items
  each). Answer 200: ``{"rewards": [float] * B, "latency_s": float}``.
  400: malformed request, ``{"error": "..."}`` naming the field; 413: body larger than
  ``max_body_bytes``; 500: the model raised, ``{"error": "..."}``.
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
        self.httpd = ThreadingHTTPServer((host, port), handler)
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


class _Handler(BaseHTTPRequestHandler):
    owner: RewardServer
    protocol_version = "HTTP/1.1"
    server_version = "verl-ppo-reward/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # one line per request would drown the trainer's logs

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path.rstrip("/").endswith("/health") or self.path in ("/", ""):
            self._send(200, self.owner.health())
        else:
            self._send(404, {"error": f"no such path {self.path!r}; use POST /score, GET /health"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        if not self.path.rstrip("/").endswith("/score"):
            self._send(404, {"error": f"no such path {self.path!r}; use POST /score"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._send(411, {"error": "Content-Length header required"})
            return
        if length > self.owner.max_body_bytes:
            self.close_connection = True
            self._send(413, {"error": f"body of {length} bytes > max {self.owner.max_body_bytes}"})
            return
        body = self.rfile.read(length)
        try:
            obj = json.loads(body)
            answer = self.owner.score_json(obj)
        except ValueError as exc:  # JSONDecodeError is a ValueError
            self._send(400, {"error": f"bad request: {exc}"})
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
