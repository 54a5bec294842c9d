"""Adapters from dsec to the tool, environment and sandbox interfaces of RL frameworks.

- :mod:`dsec.adapters.verl`: :class:`DsecCodeTool`, a verl ``BaseTool`` (one sandbox per trajectory).
- :mod:`dsec.adapters.gym`: :class:`SandboxEnv` (Gymnasium-style shell-task env with a pure
  validator), :class:`SkyRLSandboxEnv` (SkyRL-gym ``BaseTextEnv``), :class:`RLLMSandboxEnv`
  (rLLM ``BaseEnv``).
- :mod:`dsec.adapters.sandbox`: :class:`DsecSandbox`, the rLLM / Harbor sandbox protocol.

None of these frameworks is a dependency: each adapter duck-types their interface
(and :class:`DsecCodeTool` subclasses verl's ``BaseTool`` when verl is installed).
"""

from dsec.adapters.gym import (
    Observation,
    RLLMSandboxEnv,
    SandboxEnv,
    ShellTask,
    SkyRLSandboxEnv,
    TextEnvStepOutput,
    Validator,
    extract_command,
)
from dsec.adapters.sandbox import DsecSandbox, SandboxExecResult
from dsec.adapters.verl import DsecCodeTool, ToolResponse

__all__ = [
    "DsecCodeTool",
    "DsecSandbox",
    "Observation",
    "RLLMSandboxEnv",
    "SandboxEnv",
    "SandboxExecResult",
    "ShellTask",
    "SkyRLSandboxEnv",
    "TextEnvStepOutput",
    "ToolResponse",
    "Validator",
    "extract_command",
]
