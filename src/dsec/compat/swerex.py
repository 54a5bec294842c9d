"""SWE-ReX remote runtime protocol, per sandbox under /swerex/<sandbox-id>."""

from __future__ import annotations

from fastapi import APIRouter


def swerex_router() -> APIRouter:
    return APIRouter(prefix="/swerex/{sid}")
