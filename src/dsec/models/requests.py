"""Request bodies of the apiserver's and the edge's routes that are no resource of their own."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from dsec.models.iam import Quota
from dsec.models.pools import PoolSpec
from dsec.models.sandbox import SandboxSpec


class BatchCreate(BaseModel):
    count: int = Field(ge=1, le=1024)
    spec: SandboxSpec


class BatchStop(BaseModel):
    ids: list[str] = Field(max_length=4096)


class RegisterEdge(BaseModel):
    name: str
    url: str


class PrewarmRequest(BaseModel):
    spec: SandboxSpec
    count: int = Field(ge=0, le=10000)


class BuildRequest(BaseModel):
    recipe: str


BackendName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,31}$")]


class ProjectCreate(BaseModel):
    name: str
    parent: str | None = None
    quota: Quota = Field(default_factory=Quota)
    allowed_backends: list[BackendName] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description='the backends its sandboxes may use (a minimum tier: e.g. ["gvisor"]); a child '
        "project may only narrow its parent's; None: whatever the parent allows",
    )


class PrincipalCreate(BaseModel):
    name: str
    projects: list[str] = Field(default_factory=list)
    admin: bool = False


class PoolPrewarm(BaseModel):
    """apiserver -> edge: keep `count` sandboxes of a pool's shape ready."""

    spec: PoolSpec
    count: int = Field(ge=0, le=10000)
    project: str | None = Field(
        None, description="the project the burst is for: a snapshot image must be its (None: an admin's)"
    )


class PullRequest(BaseModel):
    """`POST /v1/images/pull`: an image by reference from an OCI registry (Registry API v2)."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field(
        min_length=1, max_length=700, description="[registry[:port]/]repository[:tag][@sha256:...]"
    )
    name: str | None = Field(
        None,
        max_length=128,
        description="the image's name here (default: the reference's last path part and its tag); "
        "in a project: `<project>/<name>`",
    )
    project: str | None = Field(
        None,
        max_length=63,
        description="pull into this project's images (named `<project>/<name>`, seen and used by "
        "its members only), with its registry logins; admins may leave it out: an image for all",
    )


class EdgePull(BaseModel):
    """A pull as the apiserver asks it of an edge: the name decided, the login looked up."""

    model_config = ConfigDict(extra="forbid")

    reference: str = Field(max_length=700)
    name: str = Field(max_length=200)
    project: str | None = None
    username: str | None = Field(None, max_length=255)
    password: SecretStr | None = Field(None, max_length=8192)

    def wire(self) -> dict[str, Any]:
        """The JSON an edge receives (the password in clear: the cluster's channel only)."""
        out = self.model_dump(mode="json", exclude={"password"})
        out["password"] = None if self.password is None else self.password.get_secret_value()
        return out


class RegistryLogin(BaseModel):
    """`PUT /v1/projects/{project}/registries/{registry}`: the project's login to a registry;
    read back without its password."""

    model_config = ConfigDict(extra="forbid")

    username: str = Field(min_length=1, max_length=255)
    password: SecretStr = Field(min_length=1, max_length=8192, description="a password or access token")


class EdgeBuild(BaseModel):
    """A Dockerfile build as the apiserver asks it of an edge (the context tar is the body):
    the image's name decided (`<project>/...` for a project's)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=200)
    project: str | None = Field(None, max_length=63)
    dockerfile: str = Field("Dockerfile", min_length=1, max_length=1024)
    target: str | None = Field(None, max_length=128)
    build_args: dict[str, str] = Field(default_factory=dict, max_length=256)
