"""The backend interface and registry (issue #12), without starting anything."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.backends import registry
from dsec.backends.base import Backend, BackendHost, Capability
from dsec.backends.container import ContainerBackend


def test_registry_and_interface():
    assert "container" in registry.names()
    with pytest.raises(errors.InvalidRequest, match="unknown backend 'nope'; known: container"):
        registry.start("nope", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the interface is abstract: a backend must implement it all
        Backend()  # type: ignore[abstract]
    assert ContainerBackend.capabilities == frozenset(Capability)
    assert not ContainerBackend.__abstractmethods__
    assert BackendHost.__dataclass_fields__.keys() >= {"run_dir", "shim", "cgroups", "net"}


def test_the_default_backend_is_left_out_of_specs_sent_and_stored() -> None:
    from dsec.models import SandboxSpec

    assert "backend" not in SandboxSpec().model_dump() and '"backend"' not in SandboxSpec().model_dump_json()
    assert SandboxSpec.model_validate_json(SandboxSpec().model_dump_json()).backend == "container"
    assert SandboxSpec(backend="gvisor").model_dump()["backend"] == "gvisor"
    with pytest.raises(ValueError):
        SandboxSpec(backend="Not A Name")
