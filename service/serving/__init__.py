"""What every front end needs and no front end owns: lifecycle state, the per-call record, prompt encoding,
auth. Imports no grpc, starlette or uvicorn."""
