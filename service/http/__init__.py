"""The OpenAI-compatible HTTP front end and the browser playground, beside gRPC over the same serving layer.

app.py routes requests (Starlette), openai_in.py and openai_out.py translate OpenAI bodies <-> domain types,
sse.py frames
server-sent events, errors.py is the one table from errors to HTTP statuses, front.py runs uvicorn on the
process's event loop. Like service/rpc this package never sees the model."""
