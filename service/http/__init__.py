"""The OpenAI-compatible HTTP front end and the browser playground, beside gRPC on the same engine.

app.py routes requests (Starlette), openai.py translates OpenAI bodies <-> domain types, sse.py frames
server-sent events, errors.py is the one table from errors to HTTP statuses, serve.py runs uvicorn on the
gRPC server's event loop. Like service/server.py this package never sees the model."""

from service.http.serve import HttpServer

__all__ = ["HttpServer"]
