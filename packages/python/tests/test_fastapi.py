"""The ASGI middleware on FastAPI, mounted with app.add_middleware as FastAPI
users do, over the real engine component and a SQLite file: the endpoints
still get their path parameters and pydantic bodies, and a keyed POST runs
once."""

import asyncio
import json
from typing import Optional

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from pydantic import BaseModel

from idem import IdempotencyMiddleware
from idem import http as rules

from http_client import AUTH, KEY, ORDER, post, problem


class Order(BaseModel):
    sku: str
    qty: int
    note: Optional[str] = None


def make_app(env, **options):
    counts = {"orders": 0, "account_orders": 0, "refunds": 0, "flaky": 0}
    received = []

    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create_order(order: Order):
        counts["orders"] += 1
        received.append(order)
        return {"order": f"order-{1000 + counts['orders']}", "sku": order.sku, "qty": order.qty}

    @app.get("/orders")
    async def list_orders():
        return counts

    # A plain `def` endpoint: FastAPI runs it in its thread pool.
    @app.post("/accounts/{account_id}/orders", status_code=201)
    def create_account_order(account_id: int, order: Order, notify: bool = False):
        counts["account_orders"] += 1
        received.append(order)
        return {"account": account_id, "notify": notify, "sku": order.sku, "qty": order.qty, "note": order.note,
                "n": counts["account_orders"]}

    @app.post("/orders/{order_id}/refund")
    async def refund(order_id: str):
        counts["refunds"] += 1
        raise HTTPException(status_code=404, detail=f"no order {order_id}")

    @app.post("/flaky")
    async def flaky():
        counts["flaky"] += 1
        raise HTTPException(status_code=503, detail="try later", headers={"retry-after": "5"})

    app.add_middleware(IdempotencyMiddleware, idem=env.idem, **options)
    return app, counts, received


def status_of(env, key):
    return env.idem.inspect(rules.auth_scope(AUTH.encode()), "http", key)["status"]


def test_a_keyed_post_runs_once_and_the_retry_is_replayed(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    first = post(client, "/orders", key=KEY)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert first.json() == {"order": "order-1001", "sku": "A1", "qty": 2}
    assert counts["orders"] == 1

    # The same JSON written another way is the same request.
    for body in (ORDER, '{ "qty": 2, "sku": "A1" }'):
        retry = post(client, "/orders", key=KEY, body=body)
        assert retry.status_code == 201
        assert retry.headers["idempotent-replayed"] == "true"
        assert retry.headers["content-type"] == "application/json"
        assert retry.content == first.content
        assert retry.headers["content-length"] == str(len(first.content))
    assert counts["orders"] == 1
    assert status_of(env, KEY) == "succeeded"

    # Another key is another request.
    other = post(client, "/orders", key="another-key")
    assert other.status_code == 201 and other.json()["order"] == "order-1002"
    assert counts["orders"] == 2


def test_the_record_is_in_the_sqlite_file(env, make_env):
    app, counts, _ = make_app(env)
    first = post(TestClient(app), "/orders", key=KEY)
    assert first.status_code == 201
    # Another process on the same file (here: a new store, engine and app) replays it.
    restarted = make_env()
    assert restarted.path == env.path
    app2, counts2, _ = make_app(restarted)
    retry = post(TestClient(app2), "/orders", key=KEY)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert counts["orders"] == 1 and counts2["orders"] == 0


def test_the_same_key_with_another_body_is_422_key_reused(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    assert post(client, "/orders", key=KEY).status_code == 201
    reused = post(client, "/orders", key=KEY, body={"sku": "B7", "qty": 1})
    problem(reused, 422, "key-reused", "Idempotency-Key is already used")
    assert "idempotent-replayed" not in reused.headers
    assert counts["orders"] == 1


def test_a_post_without_a_key_is_400_key_missing(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    problem(post(client, "/orders"), 400, "key-missing", "Idempotency-Key is missing")
    problem(post(client, "/accounts/7/orders"), 400, "key-missing", "Idempotency-Key is missing")
    assert counts == {"orders": 0, "account_orders": 0, "refunds": 0, "flaky": 0}


def test_get_passes_through(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    assert post(client, "/orders", key=KEY).status_code == 201
    assert client.get("/orders").json()["orders"] == 1
    # Nothing is recorded for a GET, even with a key: each one reaches the endpoint.
    headers = {"authorization": AUTH, "idempotency-key": "get-key"}
    for n in (1, 5):
        counts["orders"] = n
        res = client.get("/orders", headers=headers)
        assert res.status_code == 200 and "idempotent-replayed" not in res.headers
        assert res.json()["orders"] == n
    assert env.idem.inspect(rules.auth_scope(AUTH.encode()), "http", "get-key") is None


def test_path_parameters_and_the_pydantic_body_reach_the_endpoint(env):
    app, counts, received = make_app(env)
    client = TestClient(app)
    order = {"sku": "Z9", "qty": 3, "note": "déjà vu ✓ " + "x" * 20_000}
    first = post(client, "/accounts/42/orders?notify=true", key="acct", body=order)
    assert first.status_code == 201, first.text
    assert first.json() == {"account": 42, "notify": True, "sku": "Z9", "qty": 3, "note": order["note"], "n": 1}
    assert received == [Order(**order)]

    retry = post(client, "/accounts/42/orders?notify=true", key="acct", body=order)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert counts["account_orders"] == 1

    # The path (parameters and query included) is part of the request: the
    # same key on another account or another query is a reuse.
    problem(post(client, "/accounts/43/orders?notify=true", key="acct", body=order),
            422, "key-reused", "Idempotency-Key is already used")
    problem(post(client, "/accounts/42/orders", key="acct", body=order),
            422, "key-reused", "Idempotency-Key is already used")
    assert counts["account_orders"] == 1

    # FastAPI still validates the body the middleware has read.
    other = post(client, "/accounts/43/orders", key="acct-43", body={"sku": "Q1", "qty": 1})
    assert other.status_code == 201
    assert other.json() == {"account": 43, "notify": False, "sku": "Q1", "qty": 1, "note": None, "n": 2}
    assert received[-1] == Order(sku="Q1", qty=1)


def test_a_body_in_several_chunks_reaches_the_endpoint_whole(env):
    # A server such as uvicorn hands a large body over in several messages;
    # the test client sends one, so this drives the ASGI app directly.
    app, counts, received = make_app(env)
    order = {"sku": "C3", "qty": 9, "note": "ü" * 30_000}
    raw = json.dumps(order).encode()
    parts = [raw[i:i + 8192] for i in range(0, len(raw), 8192)]
    assert len(parts) > 3

    async def call():
        messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
        sent = []

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/orders", "raw_path": b"/orders", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode()), (b"idempotency-key", b"chunks"),
                             (b"authorization", AUTH.encode())],
                 "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    sent = asyncio.run(call())
    assert sent[0]["status"] == 201
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:])) == {"order": "order-1001", "sku": "C3", "qty": 9}
    assert received == [Order(**order)] and counts["orders"] == 1
    # The whole body was fingerprinted: the same order sent in one piece is a replay.
    retry = post(TestClient(app), "/orders", key="chunks", body=order)
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert counts["orders"] == 1


def test_an_http_exception_4xx_is_a_final_failure_and_replayed(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    first = post(client, "/orders/o-77/refund", key="refund")
    assert first.status_code == 404 and first.json() == {"detail": "no order o-77"}
    assert "idempotent-replayed" not in first.headers
    assert status_of(env, "refund") == "failed"

    again = post(client, "/orders/o-77/refund", key="refund")
    assert again.status_code == 404 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["content-type"] == "application/json"
    assert counts["refunds"] == 1

    # FastAPI's own 422 (the body fails the model) is a 4xx too: kept and
    # replayed, and the endpoint never ran.
    bad = post(client, "/orders", key="bad-qty", body={"sku": "A1", "qty": "many"})
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/json"
    assert bad.json()["detail"][0]["loc"] == ["body", "qty"]
    bad2 = post(client, "/orders", key="bad-qty", body={"sku": "A1", "qty": "many"})
    assert bad2.status_code == 422 and bad2.headers["idempotent-replayed"] == "true"
    assert bad2.content == bad.content
    assert counts["orders"] == 0


def test_an_http_exception_5xx_is_not_kept(env):
    app, counts, _ = make_app(env)
    client = TestClient(app)
    first = post(client, "/flaky", key="flaky")
    assert first.status_code == 503 and first.headers["retry-after"] == "5"
    assert status_of(env, "flaky") == "released"
    again = post(client, "/flaky", key="flaky")
    assert again.status_code == 503 and "idempotent-replayed" not in again.headers
    assert counts["flaky"] == 2
