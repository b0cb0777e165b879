"""The reward server answers every malformed request with a 4xx JSON error (never a
traceback, never silence) and keeps serving: named cases, then 1,000 seeded random and
malformed requests over raw sockets to a server on 127.0.0.1."""

import json
import random
import socket

import pytest
import reasoning_gym

from verl_ppo.reward import RewardServer, RuleReward

pytestmark = pytest.mark.timeout(300)


def _valid_body(rng: random.Random, entries: list[dict]) -> dict:
    n = rng.randint(1, 3)
    picked = [rng.choice(entries) for _ in range(n)]
    return {
        "prompt_ids": [[1, 2, i] for i in range(n)],
        "response_ids": [[3, i] for i in range(n)],
        "prompts": [e["question"] for e in picked],
        "responses": [f"<answer>{e['answer']}</answer>" for e in picked],
        "entries": picked,
    }


def _junk(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "none", "bool", "list", "dict"]
    k = rng.choice(kinds if depth < 3 else kinds[:5])
    if k == "int":
        return rng.choice([0, -1, 2**70, rng.randint(-100, 100)])
    if k == "float":
        return rng.choice([0.5, -1e308, 1e-300])
    if k == "str":
        return "".join(chr(rng.randint(1, 0x2FF)) for _ in range(rng.randint(0, 12)))
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {str(_junk(rng, 3)): _junk(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _mutated_body(rng: random.Random, entries: list[dict]) -> bytes:
    """A request body: a valid batch with one field broken, an entry without
    ``metadata.source_dataset``, JSON of the wrong shape, or bytes that are not JSON."""
    body = _valid_body(rng, entries)
    kind = rng.randrange(8)
    if kind == 0:
        del body[rng.choice(list(body))]
    elif kind == 1:
        body[rng.choice(list(body))] = _junk(rng)
    elif kind == 2:
        body["entries"] = [{"question": "1+1", "answer": "2"} for _ in body["entries"]]
    elif kind == 3:
        body["entries"] = [dict(e, metadata=_junk(rng)) for e in body["entries"]]
    elif kind == 4:
        body["entries"] = [
            dict(e, metadata={"source_dataset": _junk(rng)}) for e in body["entries"]
        ]
    elif kind == 5:
        f = rng.choice(["prompt_ids", "response_ids", "prompts", "responses"])
        body[f] = [_junk(rng) for _ in body[f]]
    elif kind == 6:
        return json.dumps(_junk(rng)).encode()
    else:
        raw = json.dumps(body).encode()
        return raw[: rng.randrange(len(raw))] + bytes(rng.randrange(256) for _ in range(3))
    return json.dumps(body).encode()


def _request(rng: random.Random, entries: list[dict]) -> tuple[bytes, bool]:
    """``(raw bytes, whether a 200 is acceptable)``: one random request."""
    kind = rng.randrange(10)
    if kind == 0:  # a well-formed request: must be scored
        body = json.dumps(_valid_body(rng, entries)).encode()
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body, True
    if kind == 1:  # random bytes as a request
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))) + b"\r\n\r\n", False
    if kind == 2:  # a bad Content-Length
        cl = rng.choice(["-5", "-1", "abc", "", "1e3", "99999999999999999999", " 3", "0x10"])
        return f"POST /score HTTP/1.1\r\nContent-Length: {cl}\r\n\r\n{{}}".encode(), False
    if kind == 3:  # a body shorter than its Content-Length (then the client stops sending)
        body = json.dumps(_valid_body(rng, entries)).encode()
        return (
            f"POST /score HTTP/1.1\r\nContent-Length: {len(body) + 50}\r\n\r\n".encode() + body,
            False,
        )
    if kind == 4:  # an unknown method, path or protocol
        line = rng.choice(
            ["PUT /score HTTP/1.1", "DELETE / HTTP/1.1", "GET /nope HTTP/1.1", "GET /",
             "POST /score HTTP/9.9", "POST /score HTTP/1.1 extra", "BREW /pot HTCPCP/1.0",
             "POST /other HTTP/1.1"]
        )  # fmt: skip
        return f"{line}\r\nContent-Length: 2\r\n\r\n{{}}".encode(), False
    if kind == 5:  # an over-long header
        return b"GET /health HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n", False
    body = _mutated_body(rng, entries)
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body, True  # a mutation may still be a valid batch


def _exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, close the sending side, read the answer until the server closes or the
    first response is complete."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                return data
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                length = [
                    x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")
                ]
                if length and len(body) >= int(length[0].split(b":")[1]):
                    return data


def _check(answer: bytes, may_succeed: bool, raw: bytes) -> int:
    head, sep, body = answer.partition(b"\r\n\r\n")
    assert sep, f"no HTTP answer to {raw[:120]!r}: {answer[:200]!r}"
    status = int(head.split(b" ")[1])
    obj = json.loads(body)  # JSON, not an HTML page or a traceback
    if status == 200:
        assert may_succeed, raw[:200]
        assert all(0.0 <= r <= 1.0 for r in obj["rewards"])
    else:
        assert 400 <= status < 500, (status, obj, raw[:200])
        assert isinstance(obj["error"], str) and "Traceback" not in obj["error"]
    return status


def test_named_malformed_requests_get_4xx_json():
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=3))
    with RewardServer(RuleReward(), port=0, idle_timeout_s=5) as server:
        neg = _exchange(server.port, b"POST /score HTTP/1.1\r\nContent-Length: -5\r\n\r\n{}")
        assert _check(neg, False, b"") == 400 and b"Content-Length" in neg
        body = _valid_body(random.Random(0), entries)
        body["entries"] = [{"question": "1+1", "answer": "2"} for _ in body["entries"]]
        data = json.dumps(body).encode()
        raw = f"POST /score HTTP/1.1\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        ans = _exchange(server.port, raw)
        assert _check(ans, False, raw) == 400 and b"metadata.source_dataset" in ans
        assert _check(_exchange(server.port, b"PUT /score HTTP/1.1\r\n\r\n"), False, b"") == 405


def test_one_thousand_random_requests_then_still_serving(capsys):
    rng = random.Random(20261202)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=16, seed=5))
    statuses: dict[int, int] = {}
    with RewardServer(RuleReward(), port=0, idle_timeout_s=5, max_body_bytes=1 << 16) as server:
        for _ in range(1000):
            raw, may_succeed = _request(rng, entries)
            status = _check(_exchange(server.port, raw), may_succeed, raw)
            statuses[status] = statuses.get(status, 0) + 1
        body = json.dumps(_valid_body(rng, entries)).encode()
        raw = f"POST /score HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        assert _check(_exchange(server.port, raw), True, raw) == 200  # still serving
        health = _exchange(server.port, b"GET /health HTTP/1.1\r\n\r\n")
        assert json.loads(health.partition(b"\r\n\r\n")[2])["status"] == "ok"
    assert statuses.get(200, 0) >= 50 and sum(v for k, v in statuses.items() if k >= 400) >= 500
    assert "Traceback" not in capsys.readouterr().err
