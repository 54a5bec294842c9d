"""A verl multi-turn tool that runs code in dsec sandboxes.

Mirrors verl's ``verl.tools.base_tool.BaseTool`` (verl >= 0.5)::

    __init__(config: dict, tool_schema: OpenAIFunctionToolSchema)
    get_openai_tool_schema() -> OpenAIFunctionToolSchema
    async create(instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]
    async execute(instance_id: str, parameters: dict, **kwargs) -> tuple[ToolResponse, float, dict]
    async calc_reward(instance_id: str, **kwargs) -> float
    async release(instance_id: str, **kwargs) -> None

Lifecycle: ``create`` -> ``execute`` (any number of times) -> ``calc_reward`` -> ``release``.
When verl is importable :class:`DsecCodeTool` subclasses its ``BaseTool`` and answers
with its ``ToolResponse``; otherwise it duck-types the same interface with a local
:class:`ToolResponse`.

One sandbox per trajectory. By default the trajectory *is* the instance id: the
sandbox is created on the first ``execute``, reused by every later one (Python
variables, files, the shell's cwd survive) and stopped by ``release``. verl's
``ToolAgentLoop`` instead calls create/execute/release around every single tool
call; for state to survive there, pass ``trajectory_id=...`` (directly or inside
``create_kwargs``): the sandbox is then keyed by that id, outlives ``release`` of
the instance, and is stopped by :meth:`DsecCodeTool.release_trajectory`,
:meth:`DsecCodeTool.aclose`, or the sandbox's idle TTL.

Config keys (all optional): ``image`` ("python"), ``cpu`` (1.0), ``memory_mb`` (1024),
``ttl_idle_s`` (900), ``timeout`` per call in seconds (30), ``max_output_chars`` (4096),
``code_language`` ("python": ``code`` runs in a persistent Python interpreter;
"bash": in the persistent shell), ``url`` / ``token`` (else the SDK defaults),
``reward_command`` (see :meth:`DsecCodeTool.calc_reward`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from dsec import errors
from dsec.adapters._output import render
from dsec.client import AsyncClient, AsyncSandbox, AsyncSession

__all__ = ["DEFAULT_TOOL_SCHEMA", "VERL_AVAILABLE", "DsecCodeTool", "ToolResponse"]

DEFAULT_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": (
            "Run Python code or a shell command in a sandbox private to this conversation. "
            "Variables, files and the working directory persist between calls."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python source to run"},
                "command": {"type": "string", "description": "a bash command line to run"},
            },
            "required": [],
        },
    },
}


@dataclass
class _LocalToolResponse:
    """Stand-in for ``verl.tools.schemas.ToolResponse`` when verl is not installed."""

    text: str = ""
    image: list[Any] | None = None
    video: list[Any] | None = None


def _load_verl() -> tuple[type[Any], type[Any], type[Any]] | None:
    try:
        base = importlib.import_module("verl.tools.base_tool").BaseTool
        schemas = importlib.import_module("verl.tools.schemas")
        return base, schemas.ToolResponse, schemas.OpenAIFunctionToolSchema
    except (ImportError, AttributeError):
        return None


_VERL = _load_verl()
VERL_AVAILABLE = _VERL is not None

if TYPE_CHECKING:
    _BaseTool = object
    ToolResponse = _LocalToolResponse
else:
    _BaseTool = _VERL[0] if _VERL else object
    ToolResponse = _VERL[1] if _VERL else _LocalToolResponse


def _schema(tool_schema: Any) -> Any:
    """The schema as verl wants it (its pydantic model) when verl is there, else a dict."""
    if tool_schema is None:
        tool_schema = DEFAULT_TOOL_SCHEMA
    if _VERL is not None and isinstance(tool_schema, dict):
        return _VERL[2].model_validate(tool_schema)
    return tool_schema


def _schema_name(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema["function"]["name"])
    return str(schema.function.name)


def _parameters(parameters: dict[str, Any] | str) -> dict[str, Any]:
    """verl passes a dict; accept its JSON text too, and bare text as code."""
    if isinstance(parameters, dict):
        return parameters
    try:
        parsed = json.loads(parameters)
    except ValueError:
        return {"code": parameters}
    return parsed if isinstance(parsed, dict) else {"code": parameters}


@dataclass
class _Trajectory:
    """The sandbox of one trajectory and what calc_reward needs to know about it."""

    key: str
    explicit: bool  # keyed by a caller's trajectory_id: outlives release() of its instances
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox: AsyncSandbox | None = None
    sessions: dict[str, AsyncSession] = field(default_factory=dict)
    ground_truth: str | None = None
    reward_command: str | None = None
    last_output: str = ""
    calls: int = 0


class DsecCodeTool(_BaseTool):
    """verl ``BaseTool`` running ``{"code": ...}`` / ``{"command": ...}`` in one sandbox per trajectory.

    ``client`` is an :class:`AsyncClient` to share; by default the tool opens its own from
    ``config["url"]`` / ``config["token"]`` or the SDK's defaults, and closes it in :meth:`aclose`.
    """

    def __init__(
        self,
        config: dict[str, Any] | None = None,
        tool_schema: Any = None,
        *,
        client: AsyncClient | None = None,
    ) -> None:
        # verl's BaseTool.__init__ only sets these three (and prints the schema), so it is not called.
        self.config: dict[str, Any] = dict(config or {})
        self.tool_schema: Any = _schema(tool_schema)
        self.name: str = _schema_name(self.tool_schema)
        self._client = client
        self._owns_client = client is None
        self._instances: dict[str, str] = {}  # instance id -> trajectory key
        self._trajectories: dict[str, _Trajectory] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    # ------------------------------------------------------------------ verl interface

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        """Register an instance; its sandbox starts on the first :meth:`execute`.

        Keyword arguments (directly or in ``create_kwargs``): ``trajectory_id`` to share one
        sandbox across instances, ``ground_truth`` / ``reward_command`` for :meth:`calc_reward`.
        """
        options = {**kwargs.get("create_kwargs", {}), **kwargs}
        instance_id = instance_id or uuid4().hex
        key = options.get("trajectory_id") or instance_id
        traj = self._trajectories.get(key)
        if traj is None:
            traj = self._trajectories[key] = _Trajectory(key, explicit="trajectory_id" in options)
        if options.get("ground_truth") is not None:
            traj.ground_truth = str(options["ground_truth"])
        traj.reward_command = options.get("reward_command") or traj.reward_command
        self._instances[instance_id] = key
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any] | str, **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        """Run the call's ``code`` or ``command``; returns (response, step reward 0.0, metrics)."""
        if instance_id not in self._instances:
            await self.create(instance_id)
        traj = self._trajectories[self._instances[instance_id]]
        params = _parameters(parameters)
        code, command = params.get("code"), params.get("command")
        if not isinstance(code, str) and not isinstance(command, str):
            return (
                ToolResponse(text="error: pass {'code': ...} or {'command': ...}"),
                0.0,
                {"error": "params"},
            )
        kind = "bash" if isinstance(command, str) else str(self.config.get("code_language", "python"))
        source = command if isinstance(command, str) else code
        assert isinstance(source, str)
        timeout = float(self.config.get("timeout", 30.0))
        try:
            async with traj.lock:
                session = await self._session(traj, kind)
                result = await session.run(source, timeout=timeout)
        except errors.DsecError as exc:
            if isinstance(exc, errors.SandboxNotFound | errors.SandboxNotRunning):
                traj.sandbox, traj.sessions = None, {}  # gone (TTL, failure): the next call starts afresh
            return ToolResponse(text=f"error: {exc}"), 0.0, {"error": exc.code}
        traj.calls += 1
        traj.last_output = result.output
        text = render(
            result.output,
            result.stderr,
            exit_code=result.exit_code,
            error=result.error,
            timed_out=result.timed_out,
            timeout=timeout,
            limit=int(self.config.get("max_output_chars", 4096)),
        )
        metrics = {
            "exit_code": result.exit_code,
            "duration": result.duration,
            "timed_out": result.timed_out,
            "truncated": result.truncated,
            "sandbox_id": traj.sandbox.id if traj.sandbox else None,
        }
        return ToolResponse(text=text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """1.0 or 0.0 from, in order: ``reward_command`` (exit code 0 of a trusted exec in the
        sandbox: the image's own tools over the sandbox's /work, the agent frozen meanwhile, so
        nothing the agent left behind can make it pass), or ``ground_truth`` (equals the last
        call's stdout, stripped); 0.0 when neither is set. A grader the platform could not run
        raises (``GraderUnavailable``): an environment fault, not a reward of 0."""
        key = self._instances.get(instance_id)
        traj = self._trajectories.get(key) if key else None
        if traj is None:
            return 0.0
        command = kwargs.get("reward_command") or traj.reward_command or self.config.get("reward_command")
        if command:
            if traj.sandbox is None:
                return 0.0
            async with traj.lock:
                result = await traj.sandbox.exec(
                    ["bash", "-c", command], timeout=float(self.config.get("timeout", 30.0)), trusted=True
                )
            return 1.0 if result.exit_code == 0 else 0.0
        truth = kwargs.get("ground_truth", traj.ground_truth)
        if truth is not None and traj.calls:
            return 1.0 if traj.last_output.strip() == str(truth).strip() else 0.0
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance; stop its sandbox unless it belongs to a named trajectory."""
        key = self._instances.pop(instance_id, None)
        traj = self._trajectories.get(key) if key else None
        if traj is not None and not traj.explicit:
            await self._drop(traj)

    # ------------------------------------------------------------------ beyond verl

    def sandbox_id(self, instance_id: str) -> str | None:
        """The id of the sandbox serving this instance, if it has started."""
        key = self._instances.get(instance_id)
        traj = self._trajectories.get(key) if key else None
        return traj.sandbox.id if traj and traj.sandbox else None

    async def release_trajectory(self, trajectory_id: str) -> None:
        """Stop the sandbox of a named trajectory (see ``trajectory_id`` in :meth:`create`)."""
        traj = self._trajectories.get(trajectory_id)
        if traj is not None:
            for instance, key in list(self._instances.items()):
                if key == trajectory_id:
                    del self._instances[instance]
            await self._drop(traj)

    async def aclose(self) -> None:
        """Stop every sandbox of this tool and close the client it opened."""
        for traj in list(self._trajectories.values()):
            with contextlib.suppress(errors.DsecError):
                await self._drop(traj)
        self._instances.clear()
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> DsecCodeTool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ internals

    def _api(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self.config.get("url"), self.config.get("token"))
        return self._client

    async def _session(self, traj: _Trajectory, kind: str) -> AsyncSession:
        if traj.sandbox is None:
            traj.sandbox = await self._api().create(
                str(self.config.get("image", "python")),
                cpu=float(self.config.get("cpu", 1.0)),
                memory_mb=int(self.config.get("memory_mb", 1024)),
                ttl_idle_s=float(self.config.get("ttl_idle_s", 900.0)),
                labels={"dsec-adapter": "verl"},
            )
        session = traj.sessions.get(kind)
        if session is None:
            session = traj.sessions[kind] = await traj.sandbox.session(kind)
        return session

    async def _drop(self, traj: _Trajectory) -> None:
        self._trajectories.pop(traj.key, None)
        sandbox, traj.sandbox, traj.sessions = traj.sandbox, None, {}
        if sandbox is not None:
            await sandbox.stop()
