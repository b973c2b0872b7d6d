"""The ASGI middleware on Starlette answers the README's curl session as the proxy does."""

import json

import pytest
from starlette.applications import Starlette
from starlette.responses import Response as HttpResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from idem import IdempotencyMiddleware

from http_client import KEY, post, problem


def make_app(env, **options):
    counts = {"orders": 0, "flaky": 0}

    async def orders(request):
        counts["orders"] += 1
        body = f'{{"order":"order-{1000 + counts["orders"]}"}}\n'
        return HttpResponse(body, status_code=201, media_type="application/json")

    async def list_orders(request):
        return HttpResponse(json.dumps(counts), media_type="application/json")

    async def teapot(request):
        return HttpResponse("short and stout", status_code=418)

    async def flaky(request):
        counts["flaky"] += 1
        return HttpResponse("try later", status_code=503)

    async def echo(request):
        return HttpResponse(await request.body(), status_code=200)

    async def boom(request):
        raise RuntimeError("the handler crashed")

    app = Starlette(routes=[
        Route("/orders", orders, methods=["POST"]),
        Route("/orders", list_orders, methods=["GET"]),
        Route("/teapot", teapot, methods=["POST"]),
        Route("/flaky", flaky, methods=["POST"]),
        Route("/echo", echo, methods=["POST"]),
        Route("/boom", boom, methods=["POST"]),
    ])
    app.add_middleware(IdempotencyMiddleware, idem=env.idem, **options)
    return app, counts


def test_the_readme_curl_session(env):
    app, counts = make_app(env)
    client = TestClient(app)
    first = post(client, "/orders", key=f'"{KEY}"')
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert first.text == '{"order":"order-1001"}\n'

    retry = post(client, "/orders", key=KEY, body='{ "qty": 2, "sku": "A1" }')
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["content-type"] == "application/json"
    assert retry.headers["content-length"] == "23"
    assert retry.text == '{"order":"order-1001"}\n'
    assert counts["orders"] == 1

    reused = post(client, "/orders", key=KEY, body='{"sku":"B7","qty":1}')
    problem(reused, 422, "key-reused", "Idempotency-Key is already used")
    assert reused.content == (b'{"detail":"This Idempotency-Key was already used with a different request (method, path or body). '
                              b'Use a new key for a new request.","status":422,"title":"Idempotency-Key is already used",'
                              b'"type":"tag:idem.invalid,2026:problems/key-reused"}')

    problem(post(client, "/orders"), 400, "key-missing", "Idempotency-Key is missing")
    anon = post(client, "/orders", key=KEY, auth=None)
    problem(anon, 401, "client-unidentified", "The client is not identified")
    assert anon.headers["www-authenticate"] == 'Bearer realm="idem"'
    assert counts["orders"] == 1


def test_scope_is_per_client(env):
    app, counts = make_app(env)
    client = TestClient(app)
    assert post(client, "/orders", key="k", auth="Bearer bob").status_code == 201
    assert post(client, "/orders", key="k", auth="Bearer carol").status_code == 201
    assert counts["orders"] == 2


def test_safe_methods_and_invalid_keys(env):
    app, _ = make_app(env)
    client = TestClient(app)
    assert client.get("/orders").status_code == 200
    problem(post(client, "/orders", key='"unterminated'), 400, "key-invalid", "Idempotency-Key is invalid")
    long = problem(post(client, "/orders", key="x" * 256), 400, "key-invalid", "Idempotency-Key is invalid")
    assert (long["field"], long["rule"]) == ("idem-key", "too-long")
    problem(post(client, "/orders", key="bad-json", body="{"), 400, "invalid-request", "Request is invalid")


def test_request_body_reaches_the_handler(env):
    app, _ = make_app(env)
    client = TestClient(app)
    res = post(client, "/echo", key="echo", body="raw bytes", ctype="text/plain")
    assert res.text == "raw bytes"


def test_in_progress_is_409_with_retry_after(env):
    app, _ = make_app(env)
    client = TestClient(app)
    # The first request's owner: claimed through the engine, as a running request would be.
    from idem import http as rules
    d = env.idem.begin(rules.auth_scope(b"Bearer alice-token"), "http", "busy",
                       body=b'{"sku":"A1","qty":2}', body_kind="json",
                       attributes=[("method", "POST"), ("path", "/orders")])
    assert d.decision == "execute"
    res = post(client, "/orders", key="busy")
    problem(res, 409, "request-in-progress", "A request is outstanding for this Idempotency-Key")
    assert int(res.headers["retry-after"]) >= 1


def test_4xx_stored_5xx_not(env):
    app, counts = make_app(env)
    client = TestClient(app)
    assert post(client, "/teapot", key="tea").status_code == 418
    t2 = post(client, "/teapot", key="tea")
    assert t2.status_code == 418 and t2.headers["idempotent-replayed"] == "true" and t2.text == "short and stout"
    assert post(client, "/flaky", key="flaky").status_code == 503
    f2 = post(client, "/flaky", key="flaky")
    assert f2.status_code == 503 and "idempotent-replayed" not in f2.headers
    assert counts["flaky"] == 2


def test_body_too_large(env):
    app, _ = make_app(env, policy={"max_body_bytes": 10})
    client = TestClient(app)
    body = problem(post(client, "/echo", key="big", body="x" * 11), 413, "body-too-large", "Request body is too large")
    assert body["max_body_bytes"] == 10


def test_store_failure_is_503(env):
    app, counts = make_app(env)
    client = TestClient(app)
    env.store.connection.execute("DROP TABLE idempotency_record")
    res = post(client, "/orders", key="k")
    problem(res, 503, "store-unavailable", "Idempotency store is unavailable")
    assert res.headers["retry-after"] == "1"
    assert counts["orders"] == 0


def test_crashed_handler_leaves_the_outcome_unknown(env):
    app, _ = make_app(env)
    client = TestClient(app, raise_server_exceptions=False)
    first = post(client, "/boom", key="boom")
    assert first.status_code == 500
    again = post(client, "/boom", key="boom")
    problem(again, 409, "outcome-unknown", "The outcome of the request is unknown")
