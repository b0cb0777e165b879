"""RewardServer + RemoteReward over real loopback HTTP: round trip, errors, retries,
timeouts, server down, and the ``reward-server`` command in a subprocess."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import reasoning_gym
import torch

from verl_comm.distributed.launch import free_port
from verl_ppo.reward import (
    AsyncRewardScorer,
    RemoteReward,
    RemoteRewardError,
    RewardBatch,
    RewardServer,
    RuleReward,
)

pytestmark = pytest.mark.timeout(120)


def _rg_batch(n=4, seed=11):
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=n, seed=seed))
    texts = [
        f"<answer>{e['answer']}</answer>" if i % 2 == 0 else "<answer>nope</answer>"
        for i, e in enumerate(entries)
    ]
    return RewardBatch(
        [(1, 2, i) for i in range(n)],
        [(3, i) for i in range(n)],
        [e["question"] for e in entries],
        texts,
        entries,
    )


def test_round_trip_matches_local_and_health():
    batch = _rg_batch()
    local = RuleReward().score(batch)
    with RewardServer(RuleReward(), port=0) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        client = RemoteReward(server.url, timeout_s=10)
        for _ in range(3):  # kept-alive connection reused
            out = client.score(batch)
            # bit-equality is the property: the server scores with the same RuleReward, and
            # JSON carries each float32 as a float64 repr, which round-trips exactly on any CPU
            assert out.dtype == torch.float32 and torch.equal(out, local)
        assert out.tolist() == [1.0, 0.0, 1.0, 0.0]
        h = client.health()
        assert h["status"] == "ok" and h["model"] == "rule" and h["batches"] == 3
        assert h["samples"] == 12 and client.retries == 0
        with AsyncRewardScorer(client, max_workers=2) as s:  # one connection per thread
            futs = [s.submit(batch) for _ in range(4)]
            assert all(torch.equal(f.result(timeout=30), local) for f in futs)


def test_bad_request_and_model_error_are_not_retried():
    class Broken:
        name = "broken"

        def score(self, batch):
            raise RuntimeError("scorer exploded")

    with RewardServer(Broken(), port=0) as server:
        client = RemoteReward(server.url, max_retries=3, backoff_s=0.5)
        t0 = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=r"HTTP 500.*scorer exploded"):
            client.score(_rg_batch(2))
        assert time.perf_counter() - t0 < 0.5 and client.retries == 0
        conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
        conn.request("POST", "/score", body=json.dumps({"prompts": []}))
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        conn.request("POST", "/score", body=b"{not json")
        resp2 = conn.getresponse()
        reply2 = json.loads(resp2.read())
        conn.close()
        assert resp.status == 400 and "missing field" in reply["error"]
        assert resp2.status == 400 and "bad request" in reply2["error"]


def test_server_down_is_a_clear_error_within_bounded_time():
    port = free_port()  # nothing listens there any more
    url = f"http://127.0.0.1:{port}"
    client = RemoteReward(url, timeout_s=1.0, max_retries=3, backoff_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(RemoteRewardError) as info:
        client.score(_rg_batch(2))
    elapsed = time.perf_counter() - t0
    msg = str(info.value)
    assert url in msg and "4 attempt(s)" in msg and "reward-server" in msg
    assert client.retries == 3
    assert 0.05 + 0.1 + 0.2 <= elapsed < 5.0  # the backoff sleeps, and bounded


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 ``fail`` times, then a valid reward list; or hangs ``hang_s``."""

    protocol_version = "HTTP/1.1"
    fail = 2
    hang_s = 0.0
    seen: list

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(time.perf_counter())
        if self.hang_s:
            time.sleep(self.hang_s)
        if len(self.seen) <= self.fail:
            status, obj = 503, {"error": "warming up"}
        else:
            status, obj = 200, {"rewards": [0.25] * len(body["responses"])}
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _serve(handler):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_retries_with_exponential_backoff_then_success():
    handler = type("H", (_Flaky,), {"fail": 2, "seen": []})
    httpd = _serve(handler)
    try:
        client = RemoteReward(f"http://127.0.0.1:{httpd.server_address[1]}", backoff_s=0.1)
        assert client.score(_rg_batch(3)).tolist() == [0.25] * 3
        t = handler.seen
        assert client.retries == 2 and len(t) == 3
        assert t[1] - t[0] >= 0.1 and t[2] - t[1] >= 0.2  # doubled
        handler2 = type("H2", (_Flaky,), {"fail": 100, "seen": []})
        httpd.RequestHandlerClass = handler2
        client2 = RemoteReward(client.url, max_retries=2, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match=r"3 attempt\(s\).*HTTP 503: warming up"):
            client2.score(_rg_batch(1))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_hung_server_times_out_within_deadline():
    handler = type("H", (_Flaky,), {"fail": 0, "hang_s": 3.0, "seen": []})
    httpd = _serve(handler)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        client = RemoteReward(url, timeout_s=0.3, max_retries=5, backoff_s=0.05, deadline_s=1.0)
        t0 = time.perf_counter()
        with pytest.raises(RemoteRewardError, match=r"timed out") as info:
            client.score(_rg_batch(1))
        assert url in str(info.value)
        assert time.perf_counter() - t0 < 1.0 + 0.3 + 0.2
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="http://host:port"):
        RemoteReward("127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteReward("http://127.0.0.1:1", timeout_s=0)


def test_reward_server_command_in_subprocess():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "verl_ppo.reward.server", "--port", "0", "--model", "rule"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "serving rule on http://127.0.0.1:" in line, proc.stderr.read()
        url = line.split(" on ")[1].strip()
        batch = _rg_batch()
        assert torch.equal(RemoteReward(url).score(batch), RuleReward().score(batch))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    bad = subprocess.run(
        [sys.executable, "-m", "verl_ppo.reward.server", "--model", "nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert bad.returncode == 2 and "unknown reward model 'nonsense'" in bad.stderr


def test_idle_connection_closed_by_server_is_resent_transparently():
    batch = _rg_batch(2)
    with RewardServer(RuleReward(), port=0, idle_timeout_s=0.2) as server:
        client = RemoteReward(server.url, max_retries=0)
        first = client.score(batch)
        time.sleep(0.6)  # the server drops the kept-alive connection meanwhile
        assert torch.equal(client.score(batch), first) and client.retries == 0
        client.close()
