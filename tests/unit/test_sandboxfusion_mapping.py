"""SandboxFusion status mapping and authentication switches, with a fake fncall backend
(control-plane logic only; the real runs are in tests/e2e/test_sandboxfusion.py)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dsec import errors
from dsec.compat.sandboxfusion import sandboxfusion_router
from dsec.http.routes import install_error_handlers
from dsec.models import FnCallRequest, FnCallResult, JupyterRequest, JupyterResult, Stage


def app(*, auth: bool, run_result: FnCallResult | Exception) -> TestClient:
    async def run(req: FnCallRequest) -> FnCallResult:
        if isinstance(run_result, Exception):
            raise run_result
        return run_result

    async def jupyter(req: JupyterRequest) -> JupyterResult:
        return JupyterResult(driver=Stage(status="Finished", return_code=0), cells=[], worker="w")

    def authenticate(token: str | None) -> None:
        if token != "good":
            raise errors.AuthError("bad token")

    a = FastAPI()
    install_error_handlers(a)
    a.include_router(sandboxfusion_router(run, jupyter, authenticate if auth else None))
    return TestClient(a)


OK = FnCallResult(
    run=Stage(status="Finished", return_code=0, stdout="1\n"), files={"a": "eA==", "b": None}, worker="w1"
)


@pytest.mark.parametrize(
    ("result", "status"),
    [
        (OK, "Success"),
        (FnCallResult(run=Stage(status="Error", return_code=2), worker="w"), "Failed"),
        (FnCallResult(run=Stage(status="TimeLimitExceeded"), worker="w"), "Failed"),
        (FnCallResult(compile=Stage(status="Error", return_code=1), run=None, worker="w"), "Failed"),
        (errors.Unavailable("edge down"), "SandboxError"),
    ],
)
def test_status_mapping(result: FnCallResult | Exception, status: str) -> None:
    r = app(auth=False, run_result=result).post("/run_code", json={"code": "x", "language": "python"})
    assert r.status_code == 200 and r.json()["status"] == status


def test_missing_fetched_files_are_left_out() -> None:
    r = app(auth=False, run_result=OK).post("/run_code", json={"code": "x"})
    assert r.json()["files"] == {"a": "eA=="}
    assert r.json()["executor_pod_name"] == "w1"


def test_auth_in_path_query_header_or_off() -> None:
    c = app(auth=True, run_result=OK)
    body = {"code": "x", "language": "python"}
    assert c.post("/run_code", json=body).status_code == 401
    assert c.post("/run_code?token=bad", json=body).status_code == 401
    assert c.post("/run_code?token=good", json=body).json()["status"] == "Success"
    assert c.post("/sandboxfusion/good/run_code", json=body).json()["status"] == "Success"
    assert c.post("/run_code", json=body, headers={"Authorization": "Bearer good"}).status_code == 200
    assert app(auth=False, run_result=OK).post("/run_code", json=body).status_code == 200
    assert c.get("/v1/ping").json() == "pong"
    assert c.get("/sandboxfusion/good/v1/ping").json() == "pong"
    # run_jupyter takes its token from the path too, and refuses a wrong one
    cells = {"cells": ["1"]}
    assert c.post("/sandboxfusion/good/run_jupyter", json=cells).json()["driver"]["status"] == "Finished"
    assert c.post("/sandboxfusion/bad/run_jupyter", json=cells).status_code == 401
    assert c.post("/run_jupyter", json=cells).status_code == 401


def test_bad_input_is_422_like_sandboxfusion() -> None:
    c = app(auth=False, run_result=OK)
    assert c.post("/run_code", json={"language": "python"}).status_code == 422
    assert c.post("/run_jupyter", json={"cells": "not a list"}).status_code == 422
    assert c.post("/run_code", json={"code": "x", "language": "klingon"}).status_code == 422
