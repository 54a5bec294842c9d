"""The dsec SDK: sync and asyncio clients over the HTTP API (``docs/API.md``).

from dsec.client import Client

with Client() as client, client.create("python") as sb:
    print(sb.exec("python -c 'print(1 + 1)'").stdout)
    sb.files.write("/work/a.txt", "hello")
"""

from dsec.client._async import AsyncClient, AsyncFiles, AsyncSandbox, AsyncSession
from dsec.client._sync import Client, Files, Sandbox, Session
from dsec.models import ExecResult, FileStat, SandboxInfo, SessionResult

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "ExecResult",
    "FileStat",
    "Files",
    "Sandbox",
    "SandboxInfo",
    "Session",
    "SessionResult",
]
