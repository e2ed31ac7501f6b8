"""Fuzzing the running mesh: hypothesis-generated requests and raw bytes on the gateway's gRPC door,
schemathesis on its HTTP API, and authenticated internal RPCs. Pass: no INTERNAL/UNKNOWN or 5xx,
no process dies, and the mesh keeps serving the same tokens."""
