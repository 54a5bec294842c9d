"""Shell-task environments over a dsec sandbox, in the shapes RL frameworks expect.

:class:`SandboxEnv` mirrors the Gymnasium ``Env`` interface::

    reset(seed=None, options=None) -> (observation, info)
    step(action: str) -> (observation, reward, terminated, truncated, info)
    close() -> None

An action is a shell command; it runs in one persistent bash session (cwd, variables
and files carry over between steps). The reward comes from a pluggable *validator*,
a pure function ``Observation -> float``: it sees the command, its output and exit
code, the step index and a snapshot of the files the task declares it checks (read
through the files API after every step), and nothing else, so rewards are
reproducible from recorded observations. The episode terminates when the reward
reaches ``success_reward`` and is truncated after ``max_steps`` steps.

Two thin wrappers adapt it to other frameworks:

- :class:`SkyRLSandboxEnv` mirrors SkyRL-gym's ``BaseTextEnv``:
  ``init(prompt) -> (prompt, metadata)``,
  ``step(action) -> {observations, reward, done, metadata}``, ``close()``.
- :class:`RLLMSandboxEnv` mirrors rLLM's ``BaseEnv``:
  ``reset() -> (obs, info)``, ``step(action) -> (obs, reward, done, info)``, ``close()``,
  ``from_dict(info)``, ``is_multithread_safe()``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypedDict

from dsec import errors
from dsec.adapters._output import render
from dsec.client import Client, Sandbox, Session
from dsec.client._base import EndsOnExit

__all__ = [
    "Observation",
    "RLLMSandboxEnv",
    "SandboxEnv",
    "ShellTask",
    "SkyRLSandboxEnv",
    "TextEnvStepOutput",
    "Validator",
    "extract_command",
]


@dataclass(frozen=True)
class Observation:
    """What one step produced; the validator's only input."""

    command: str
    output: str  # stdout and stderr merged, in order (bash session)
    exit_code: int
    step: int  # 1 for the first action
    files: Mapping[str, str | None]  # the task's checked files after the step; None: missing or unreadable
    timed_out: bool = False


Validator = Callable[[Observation], float]


@dataclass(frozen=True)
class ShellTask:
    """A task: an instruction, the files to seed, setup commands, the files the validator reads."""

    instruction: str
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    checked_files: tuple[str, ...] = ()
    image: str = "python"


class SandboxEnv(EndsOnExit):
    """A Gymnasium-style env: one fresh sandbox per episode, one bash session per sandbox.

    ``client`` is shared if given; otherwise the env opens one with the SDK defaults
    and closes it in :meth:`close`. ``reset`` must be called before ``step``.
    """

    def __init__(
        self,
        task: ShellTask,
        validator: Validator,
        *,
        max_steps: int = 10,
        success_reward: float = 1.0,
        command_timeout: float = 30.0,
        max_output_chars: int = 8192,
        client: Client | None = None,
        cpu: float = 1.0,
        memory_mb: int = 1024,
        ttl_idle_s: float = 900.0,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.task = task
        self.validator = validator
        self.max_steps = max_steps
        self.success_reward = success_reward
        self.command_timeout = command_timeout
        self.max_output_chars = max_output_chars
        self._client = client
        self._owns_client = client is None
        self._spec: dict[str, Any] = {"cpu": cpu, "memory_mb": memory_mb, "ttl_idle_s": ttl_idle_s}
        self.sandbox: Sandbox | None = None
        self._shell: Session | None = None
        self.steps = 0
        self.done = False
        self.seed: int | None = None

    # ------------------------------------------------------------------ gym interface

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Start a new episode in a fresh sandbox; returns the task instruction and ``{"sandbox_id"}``."""
        self._stop_sandbox()
        self.seed, self.steps, self.done = seed, 0, False
        if self._client is None:
            self._client = Client()
        sandbox = self._client.create(self.task.image, labels={"dsec-adapter": "gym"}, **self._spec)
        self.sandbox = sandbox
        try:
            for path, content in self.task.files.items():
                sandbox.files.write(path, content)
            for command in self.task.setup:
                r = sandbox.exec(["bash", "-c", command], timeout=self.command_timeout)
                if r.exit_code != 0:
                    raise RuntimeError(f"task setup {command!r} failed ({r.exit_code}): {r.stderr.strip()}")
            self._shell = sandbox.session("bash")
        except BaseException:
            self._stop_sandbox()
            raise
        return self.task.instruction, {"sandbox_id": sandbox.id, "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run ``action`` in the session, snapshot the checked files, score with the validator."""
        if self.sandbox is None or self._shell is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode is over: call reset()")
        self.steps += 1
        result = self._shell.run(action, timeout=self.command_timeout)
        obs = Observation(
            command=action,
            output=result.output,
            exit_code=result.exit_code,
            step=self.steps,
            files=MappingProxyType(self._snapshot()),
            timed_out=result.timed_out,
        )
        reward = float(self.validator(obs))
        terminated = reward >= self.success_reward
        truncated = not terminated and self.steps >= self.max_steps
        self.done = terminated or truncated
        text = render(
            result.output,
            exit_code=result.exit_code,
            timed_out=result.timed_out,
            timeout=self.command_timeout,
            limit=self.max_output_chars,
        )
        info = {"observation": obs, "sandbox_id": self.sandbox.id, "step": self.steps}
        return text, reward, terminated, truncated, info

    def close(self) -> None:
        """Stop the sandbox and close the client the env opened. Idempotent."""
        self._stop_sandbox()
        if self._client is not None and self._owns_client:
            self._client.close()
            self._client = None

    _end = close  # what leaving a `with` block does

    # ------------------------------------------------------------------ internals

    def _snapshot(self) -> dict[str, str | None]:
        assert self.sandbox is not None
        files: dict[str, str | None] = {}
        for path in self.task.checked_files:
            try:
                files[path] = self.sandbox.files.read_bytes(path).decode("utf-8", "replace")
            except (errors.NotFound, errors.InvalidRequest, errors.PathEscape):
                files[path] = None
        return files

    def _stop_sandbox(self) -> None:
        sandbox, self.sandbox, self._shell = self.sandbox, None, None
        if sandbox is not None:
            with contextlib.suppress(errors.DsecError):
                sandbox.stop()


_FENCE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)```", re.DOTALL)
_TAG = re.compile(r"<(?:bash|command)>(.*?)</(?:bash|command)>", re.DOTALL)


def extract_command(response: str) -> str | None:
    """The command in a model's response: the last ``<bash>``/``<command>`` tag or fenced
    (bash) code block; ``None`` if there is none, so prose is never run as a command."""
    for pattern in (_TAG, _FENCE):
        found = pattern.findall(response)
        if found:
            return str(found[-1]).strip() or None
    return None


class TextEnvStepOutput(TypedDict):
    """SkyRL-gym's ``BaseTextEnvStepOutput``."""

    observations: list[dict[str, str]]
    reward: float
    done: bool
    metadata: dict[str, Any]


class SkyRLSandboxEnv:
    """SkyRL-gym ``BaseTextEnv`` over a :class:`SandboxEnv`; actions are model responses.

    ``parse_action`` finds the command in a response (default :func:`extract_command`;
    pass ``str.strip`` if the actions are bare commands). A response without one costs
    a step, scores 0.0 and asks for a command.
    """

    def __init__(self, env: SandboxEnv, parse_action: Callable[[str], str | None] = extract_command) -> None:
        self.env = env
        self.parse_action = parse_action

    def init(self, prompt: list[dict[str, str]] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Reset the env; the prompt is returned as given, or built from the task instruction."""
        instruction, info = self.env.reset()
        return prompt or [{"role": "user", "content": instruction}], info

    def step(self, action: str) -> TextEnvStepOutput:
        command = self.parse_action(action)
        if command is None:  # nothing to run: costs a step, scores nothing
            self.env.steps += 1
            done = self.env.steps >= self.env.max_steps
            self.env.done = done
            message = "No command found. Reply with a bash command in a ```bash block."
            return {
                "observations": [{"role": "user", "content": message}],
                "reward": 0.0,
                "done": done,
                "metadata": {"step": self.env.steps, "parsed": False},
            }
        text, reward, terminated, truncated, info = self.env.step(command)
        obs: Observation = info["observation"]
        metadata = {
            "command": obs.command,
            "exit_code": obs.exit_code,
            "step": obs.step,
            "files": dict(obs.files),
            "timed_out": obs.timed_out,
            "sandbox_id": info["sandbox_id"],
            "parsed": True,
        }
        return {
            "observations": [{"role": "user", "content": text}],
            "reward": reward,
            "done": terminated or truncated,
            "metadata": metadata,
        }

    def close(self) -> None:
        self.env.close()


class RLLMSandboxEnv:
    """rLLM ``BaseEnv`` over a :class:`SandboxEnv`: ``done`` is terminated or truncated."""

    def __init__(self, env: SandboxEnv) -> None:
        self.env = env

    def reset(self) -> tuple[str, dict[str, Any]]:
        return self.env.reset()

    def step(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        text, reward, terminated, truncated, info = self.env.step(str(action))
        return text, reward, terminated or truncated, info

    def close(self) -> None:
        self.env.close()

    @staticmethod
    def from_dict(info: dict[str, Any]) -> RLLMSandboxEnv:
        """Build from a dataset row: ``instruction``, ``validator`` (a callable), and optionally
        ``files``, ``setup``, ``checked_files``, ``image``, ``max_steps``."""
        task = ShellTask(
            instruction=info["instruction"],
            files=info.get("files", {}),
            setup=tuple(info.get("setup", ())),
            checked_files=tuple(info.get("checked_files", ())),
            image=info.get("image", "python"),
        )
        return RLLMSandboxEnv(SandboxEnv(task, info["validator"], max_steps=int(info.get("max_steps", 10))))

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # every env has its own sandbox; the shared httpx client is thread safe
