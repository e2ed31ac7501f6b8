"""The error contract (tandem.v1.errors) names both exception hierarchies: the servers' and the SDK's
classes of one name report one gRPC code, every row has an SDK class, and a class named after no row
cannot be defined."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors as server_errors
from tandem import errors as sdk_errors
from tandem.v1.errors import ERROR_KINDS

SERVER_CLASSES = (server_errors.InvalidRequest, server_errors.Unauthenticated, server_errors.NotFound,
                  server_errors.FailedPrecondition, server_errors.Overloaded, server_errors.Unavailable,
                  server_errors.DeadlineExceeded)


def test_every_row_has_its_sdk_class():
    assert {code: cls.__name__ for code, cls in sdk_errors.ERROR_BY_CODE.items()} == {
        kind.code: kind.name for kind in ERROR_KINDS}


@pytest.mark.parametrize("server_class", SERVER_CLASSES, ids=lambda cls: cls.__name__)
def test_a_server_error_reaches_the_client_as_the_sdk_class_of_its_name(server_class):
    code = server_class.kind.code
    assert type(sdk_errors.error_from_status(code, "x")).__name__ == server_class.__name__
    assert sdk_errors.error_from_status(code, "x").code == code


def test_the_servers_base_error_is_internal():
    error = server_errors.TandemError("boom")
    assert (server_errors.grpc_status(error), server_errors.http_status(error)) == (grpc.StatusCode.INTERNAL, 500)
    assert type(sdk_errors.error_from_status(server_errors.grpc_status(error), "boom")) is sdk_errors.Internal


@pytest.mark.parametrize("base", [server_errors.TandemError, sdk_errors.TandemError], ids=["server", "sdk"])
def test_a_class_named_after_no_row_is_refused(base):
    with pytest.raises(TypeError, match=r"no error kind is named 'Teapot'.*tandem\.v1\.errors\.ERROR_KINDS"):
        type("Teapot", (base,), {})
