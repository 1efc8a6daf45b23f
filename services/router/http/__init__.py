"""The router's OpenAI-compatible HTTP API and its playground page (`SPECSERVE_ROUTER_HTTP_PORT`).

- `app.py`: the routes (FastAPI): /v1/models, /v1/chat/completions, /v1/completions, /v1/methods,
  /health, /openapi.json and the playground at /.
- `schemas.py`: the request bodies, validated once, and their translation to a `GenerateRequest`.
- `body.py`: a POST's bytes to one of those bodies, refused first by content type, size and prompt length.
- `openapi.py`: the OpenAPI document at /openapi.json.
- `generation.py`: runs a session through the router's own `start_session` / `stream_session` (the same
  path as gRPC Generate) and turns its rounds into OpenAI responses and server-sent events.
- `errors.py`: specserve's errors as OpenAI's error object with the matching HTTP status.
- `server.py`: uvicorn on a thread of the router process.
- `static/`: the playground page (one HTML file, no build step).
"""
