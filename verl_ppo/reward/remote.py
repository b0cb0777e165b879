"""HTTP client for a reward server (``verl-ppo reward-server``, :mod:`verl_ppo.reward.server`).

``POST {url}/score`` with the JSON form of a :class:`~verl_ppo.reward.base.RewardBatch`;
the answer is ``{"rewards": [float, ...]}``. Connections are kept alive (one per calling
thread). Scoring is a pure function of the batch, so a failed request is simply sent
again.

Failure handling, all bounded in time:

* connecting times out after ``connect_timeout_s``, every later socket operation (send,
  each read, i.e. the server's scoring time) after ``timeout_s``;
* connection errors, timeouts and HTTP 429/502/503/504 are retried up to ``max_retries``
  times, sleeping ``min(backoff_s * 2**k, backoff_max_s)`` before retry k (exponential
  backoff), never past ``deadline_s`` from the first attempt;
* HTTP 4xx/500 are not retried (the same batch would fail again): the server's error
  message is raised;
* a server that never answers raises :class:`RemoteRewardError` naming the URL, the
  number of attempts, the time spent and the last error.

Worst-case time to that error: ``(1 + max_retries) * (connect_timeout_s + timeout_s)``
plus the backoff sleeps, capped by ``deadline_s`` (give or take one attempt); connecting to a closed loopback port fails at once, so a
server that is down is reported within the sum of the backoffs (0.7 s by default).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import torch

from verl_ppo.reward.base import RewardBatch, RewardError, check_rewards

_RETRY_STATUS = {429, 502, 503, 504}


class RemoteRewardError(RewardError):
    """The reward server is unreachable or answered with an error."""


class RemoteReward:
    """A reward server as a :class:`~verl_ppo.reward.base.RewardModel`.

    Args:
        url: base URL of the server, e.g. ``http://127.0.0.1:8000``.
        timeout_s: seconds for each send/read of one attempt (covers the scoring time).
        connect_timeout_s: seconds to establish a TCP connection.
        max_retries: extra attempts after the first for retryable failures.
        backoff_s: sleep before the first retry; doubles each retry.
        backoff_max_s: cap of one backoff sleep.
        deadline_s: cap on the total seconds of one ``score`` call (None: no cap beyond
            the retry budget).

    Raises:
        ValueError: for a URL that is not ``http(s)://host[:port][/path]`` or bad numbers.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.1,
        backoff_max_s: float = 2.0,
        deadline_s: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward server url must look like http://host:port, got {url!r}")
        if (
            timeout_s <= 0
            or connect_timeout_s <= 0
            or max_retries < 0
            or backoff_s < 0
            or backoff_max_s < 0
        ):
            raise ValueError(
                "timeout_s and connect_timeout_s must be > 0 and max_retries, backoff_s, backoff_max_s >= 0; got "
                f"{timeout_s}, {connect_timeout_s}, {max_retries}, {backoff_s}, {backoff_max_s}"
            )
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0 or None, got {deadline_s}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.deadline_s = deadline_s
        self.name = f"remote:{self.url}"
        self._local = threading.local()
        self.retries = 0  # total retries made, for tests and metrics

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.connect_timeout_s)
            self._local.conn = conn
        if conn.sock is None:
            conn.timeout = self.connect_timeout_s
            conn.connect()
            conn.sock.settimeout(self.timeout_s)
            conn.timeout = self.timeout_s
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def close(self) -> None:
        """Close this thread's kept-alive connection (others close when their thread ends)."""
        self._drop_conn()

    def _request_once(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        conn = self._conn()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, self._base + path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.getheader("Connection", "").lower() == "close":
            self._drop_conn()
        return resp.status, data

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        t0 = time.perf_counter()
        attempts = 0
        last: str = ""
        while True:
            attempts += 1
            old = getattr(self._local, "conn", None)
            reused = old is not None and old.sock is not None
            try:
                status, data = self._request_once(method, path, body)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timeout
                self._drop_conn()
                if reused and isinstance(
                    exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)
                ):
                    # The server closed an idle kept-alive connection: resend at once.
                    attempts -= 1
                    continue
                kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
                last = f"{kind}: {exc!r}"
            else:
                if status == 200:
                    return data
                msg = _error_text(data)
                if status not in _RETRY_STATUS:
                    raise RemoteRewardError(
                        f"reward server at {self.url} answered HTTP {status} to {method} "
                        f"{path}: {msg}"
                    )
                last = f"HTTP {status}: {msg}"
            elapsed = time.perf_counter() - t0
            if attempts > self.max_retries:
                break
            sleep = min(self.backoff_s * 2 ** (attempts - 1), self.backoff_max_s)
            if self.deadline_s is not None and elapsed + sleep >= self.deadline_s:
                break
            self.retries += 1
            time.sleep(sleep)
        raise RemoteRewardError(
            f"reward server at {self.url} did not answer {method} {path}: {attempts} "
            f"attempt(s) over {time.perf_counter() - t0:.2f} s, last error {last}. Is "
            f"`verl-ppo reward-server --host {self._host} --port {self._port}` running, "
            "and is the reward url in the config right?"
        )

    def health(self) -> dict:
        """``GET /health``: the server's status dict (model name, batches served, ...).

        Raises:
            RemoteRewardError: if the server is down or answers with an error.
        """
        return json.loads(self._request("GET", "/health", None))

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Float32 ``(B,)`` rewards computed by the server.

        Raises:
            RemoteRewardError: server down (after retries), error status, or a malformed
                answer; the message names the URL.
        """
        # values JSON has no type for travel as their str, as `verl-ppo data export` writes
        # an entry (reasoning-gym's gsm_symbolic keeps Fractions in metadata.variables)
        body = json.dumps(batch.to_json(), default=str).encode()
        data = self._request("POST", "/score", body)
        try:
            rewards = json.loads(data)["rewards"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RemoteRewardError(
                f"reward server at {self.url} sent a malformed answer (want "
                f'{{"rewards": [...]}}): {data[:200]!r}'
            ) from exc
        return check_rewards(rewards, len(batch), self.name)


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"])
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")
