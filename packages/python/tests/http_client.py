"""What the ASGI middleware tests (Starlette and FastAPI) send and check."""

import json

KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"
TYPE = "tag:idem.invalid,2026:problems/"
AUTH = "Bearer alice-token"
ORDER = {"sku": "A1", "qty": 2}


def post(client, path, key=None, auth=AUTH, body=ORDER, ctype="application/json"):
    """POSTs ``body`` (text or bytes as is; anything else as compact JSON)."""
    headers = {"content-type": ctype}
    if key is not None:
        headers["idempotency-key"] = key
    if auth is not None:
        headers["authorization"] = auth
    content = body if isinstance(body, (str, bytes)) else json.dumps(body, separators=(",", ":"))
    return client.post(path, content=content, headers=headers)


def problem(res, status, slug, title):
    """Checks that ``res`` is the problem ``slug`` and returns its body."""
    assert res.status_code == status
    assert res.headers["content-type"] == "application/problem+json"
    assert res.headers["cache-control"] == "no-store"
    body = res.json()
    assert body["type"] == TYPE + slug and body["title"] == title and body["status"] == status
    return body
