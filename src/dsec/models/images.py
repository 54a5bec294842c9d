"""An image's runtime config on the wire: what an OCI image says its processes get (ENV,
WORKDIR, USER) and what it declares (ENTRYPOINT/CMD, exposed ports, labels).

An image's config is input from whoever built the image, and so hostile: every part is
bounded here, where it is read (an import, a pull), so that what a sandbox is given from it
always fits what a sandbox spec may hold (a workdir and a user of at most 256 characters,
an environment well inside what the kernel takes at exec)."""

from __future__ import annotations

import posixpath
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dsec import errors
from dsec.models.sandbox import check_env

KiB = 1024
MAX_IMAGE_ENV_VARS = 1024
MAX_IMAGE_ENV_BYTES = 256 * KiB  # + a spec's and a call's (1 MiB each) stays under the kernel's 2 MiB
MAX_ARGV_ITEMS = 1024
MAX_LIST_BYTES = 256 * KiB  # an entrypoint's, a cmd's or the labels' bytes in all
MAX_LABELS = 1024
MAX_PORTS = 1024
MAX_FIELD = 256  # a workdir or a user: the most a SandboxSpec holds (ShortStr)
_PORT = re.compile(r"^[0-9]{1,5}(/(tcp|udp|sctp))?$")
_USER = re.compile(r"^[^:\s\x00]+(:[^:\s\x00]+)?$")


def _bounded(items: list[str], what: str) -> list[str]:
    if sum(len(s) + 1 for s in items) > MAX_LIST_BYTES or any("\0" in s for s in items):
        raise ValueError(f"{what} holds more than {MAX_LIST_BYTES} bytes or a NUL byte")
    return items


class ImageConfig(BaseModel):
    """The config an image keeps (OCI image config `config`: Env, WorkingDir, User, Entrypoint,
    Cmd, ExposedPorts, Labels). Env, workdir and user are the defaults of every sandbox made
    from the image (its spec and each call override them); the rest is shown, not run."""

    model_config = ConfigDict(extra="forbid")

    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_IMAGE_ENV_VARS,
        description="Env: under a sandbox's own env and each call's (PATH too, when it sets one)",
    )
    workdir: str | None = Field(
        None, max_length=MAX_FIELD, description="WorkingDir: a sandbox's workdir when its spec names none"
    )
    user: str | None = Field(
        None,
        max_length=MAX_FIELD,
        description="User (name, uid, name:group or uid:gid, names from the image's own "
        "/etc/passwd and /etc/group): a sandbox's user when its spec names none",
    )
    entrypoint: list[str] | None = Field(None, max_length=MAX_ARGV_ITEMS)
    cmd: list[str] | None = Field(None, max_length=MAX_ARGV_ITEMS)
    exposed_ports: list[str] = Field(default_factory=list, max_length=MAX_PORTS)
    labels: dict[str, str] = Field(default_factory=dict, max_length=MAX_LABELS)

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        check_env(v)
        size = sum(len(k) + len(val) + 2 for k, val in v.items())
        if size > MAX_IMAGE_ENV_BYTES:
            raise ValueError(f"Env holds {size} bytes, over the {MAX_IMAGE_ENV_BYTES}-byte limit of an image")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        """Absolute and normal: `..` cannot climb above / (a WORKDIR of ../../etc is /etc, as the
        kernel would resolve it from /); the path is still resolved inside the sandbox's root."""
        if not v:
            return None
        if "\0" in v:
            raise ValueError("WorkingDir holds a NUL byte")
        return posixpath.normpath(posixpath.join("/", v)).replace("//", "/")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if not v:
            return None
        if not _USER.match(v):
            raise ValueError(f"User {v[:80]!r} is not a user, uid, user:group or uid:gid")
        return v

    @field_validator("entrypoint", "cmd")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else _bounded(v, "Entrypoint or Cmd")

    @field_validator("exposed_ports")
    @classmethod
    def _ports(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _PORT.match(p) or int(p.split("/")[0]) > 65535]
        if bad:
            raise ValueError(f"ExposedPorts holds {bad[0][:40]!r}: write a port as 8080 or 8080/tcp")
        return sorted(set(v))

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        _bounded([*v, *v.values()], "Labels")
        return v

    @classmethod
    def from_oci(cls, config: dict[str, Any], what: str) -> ImageConfig:
        """The config of an OCI (or docker) image config document; a part that is malformed or
        over its bound is an :class:`errors.InvalidRequest` naming it (`what`: the image)."""
        inner = config.get("config")
        if inner is None:
            return cls()
        try:
            if not isinstance(inner, dict):
                raise TypeError("config is not a JSON object")
            return cls.model_validate(
                {
                    "env": _oci_env(inner.get("Env")),
                    "workdir": inner.get("WorkingDir") or None,
                    "user": inner.get("User") or None,
                    "entrypoint": inner.get("Entrypoint"),
                    "cmd": inner.get("Cmd"),
                    "exposed_ports": list(_oci_object(inner.get("ExposedPorts"), "ExposedPorts")),
                    "labels": _oci_object(inner.get("Labels"), "Labels"),
                }
            )
        except ValidationError as e:
            first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
            field = ".".join(str(p) for p in first["loc"][:1])
            msg = f"{what}: the image config's {field} is refused: {first['msg']}"
            raise errors.InvalidRequest(msg) from None
        except (TypeError, ValueError) as e:
            raise errors.InvalidRequest(f"{what}: the image config is refused: {e}") from None


def _oci_env(env: Any) -> dict[str, str]:
    """OCI's `["K=V", ...]` as a dict (a later K wins, as at exec); bounded before it is built."""
    if env is None:
        return {}
    if not isinstance(env, list) or len(env) > MAX_IMAGE_ENV_VARS:
        raise ValueError(f"Env is not a list of at most {MAX_IMAGE_ENV_VARS} K=V strings")
    out: dict[str, str] = {}
    for item in env:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"Env entry {str(item)[:80]!r} is not K=V")
        k, _, v = item.partition("=")
        out[k] = v
    return out


def _oci_object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value
