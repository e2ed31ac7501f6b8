"""Generated gRPC/protobuf stubs of the tandem.v1 wire contracts (protos/tandem/v1).

Do not edit the *_pb2* modules: change the .proto files and run `python scripts/gen_protos.py`.
`errors.py` is hand-written: the error contract (names, status codes, retry-hint keys) of both the
servers and the SDK.
"""
