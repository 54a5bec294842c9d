"""Images pulled by reference from an OCI registry (Registry HTTP API v2), through skopeo.

skopeo (Debian's, the containers/image library podman and buildah use) speaks the registry
protocol: bearer-token and basic auth, image indexes resolved to linux/amd64, gzip and zstd
layers, every blob's digest verified as it streams and a pinned manifest digest
(`name@sha256:...`) checked. It copies into an OCI layout in a private scratch directory
on disk, which `import_oci_archive` then imports as it imports any archive: each layer
checked and unpacked into the store, the image's config kept.

What is ours to decide, and checked here before skopeo runs:

* The reference: parsed by the distribution grammar (`registry[:port]/path[:tag][@digest]`,
  `docker.io` and `library/` filled in as Docker does), so nothing else reaches skopeo's
  argv: no transport prefix, no option.
* Where the edge connects: a pull is a request the edge makes on a tenant's behalf, so a
  registry must resolve to public addresses only, over TLS; one on a loopback, private or
  link-local address (the cluster's own registry, a mirror on the LAN), or one served over
  plain HTTP, only when the operator lists it (`EdgeSettings.pull_local_registries`).
  (Redirects that skopeo follows, to a blob store, are its own; an operator who needs more
  than this puts the edges' egress behind a proxy.)
* Credentials: written for skopeo to a 0600 auth file in a 0700 directory of its own,
  removed after; never on a command line (other host users read /proc/*/cmdline), never
  logged, never returned.
* Size and time: the manifest's layer sizes are summed before any blob is fetched
  (`pull_max_bytes`), and skopeo runs under a deadline (`pull_timeout_s`).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.layers.builders.oci import import_oci_archive
from dsec.layers.store import Image, LayerStore
from dsec.layers.tool import run_tool

SKOPEO = "skopeo"
DOCKER_HUB = "docker.io"
_HUB_API = "registry-1.docker.io"  # where docker.io's registry API answers

# The distribution reference grammar (github.com/distribution/reference), anchored pieces.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]{{1,5}})?"
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)
REGISTRY_RE = re.compile(rf"^{_DOMAIN}$")  # host[:port], as a reference names it (docker.io: Hub)
_MAX_REFERENCE = 255 + 1 + 255 + 1 + 128 + 1 + 71

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Reference:
    """An image reference, normalized: `registry` (host[:port]), `repository`, and a tag or
    a digest (a digest pins the manifest; with both, the digest wins, as in Docker)."""

    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> Reference:
        if not isinstance(text, str) or not text or len(text) > _MAX_REFERENCE:
            raise errors.InvalidRequest(
                "an image reference is 1 to 700 characters, e.g. docker.io/library/python:3.12"
            )
        m = _REFERENCE.match(text)
        if m is None:
            raise errors.InvalidRequest(
                f"{text[:200]!r} is not an image reference: use [registry[:port]/]repository[:tag]"
                "[@sha256:...], lower-case repository names (e.g. ghcr.io/org/image:1.0)",
                reason="bad_reference",
            )
        domain, path = m["domain"], m["path"]
        # As Docker: a first part without '.' or ':' that is not "localhost" is a Hub path.
        if domain is not None and "." not in domain and ":" not in domain and domain != "localhost":
            domain, path = None, f"{domain}/{path}"
        if domain is None:
            domain = DOCKER_HUB
        if domain == DOCKER_HUB and "/" not in path:
            path = f"library/{path}"
        tag = m["tag"]
        if tag is None and m["digest"] is None:
            tag = "latest"
        return cls(domain, path, tag, m["digest"])

    @property
    def host(self) -> str:
        """The host part of the registry (no port, no brackets)."""
        host = self.registry.rsplit(":", 1)[0] if not self.registry.endswith("]") else self.registry
        return host.strip("[]")

    @property
    def api_registry(self) -> str:
        return _HUB_API if self.registry == DOCKER_HUB else self.registry

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out


@dataclass(frozen=True, slots=True)
class RegistryAuth:
    """A registry login (a user and a password or token). Its repr shows no secret."""

    username: str
    password: str

    def __repr__(self) -> str:
        return f"RegistryAuth(username={self.username!r}, password=<hidden>)"


@dataclass(frozen=True, slots=True)
class PullPolicy:
    """What an edge may pull from (see the module): `local` registries (host:port) may sit
    on private addresses and speak plain HTTP; `max_bytes` bounds an image's compressed
    layers; `timeout_s` a whole pull."""

    local: frozenset[str] = frozenset()
    max_bytes: int = 32 << 30
    timeout_s: float = 1800.0


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise errors.InvalidRequest(
            f"registry host {host!r} does not resolve: {e}", reason="registry_unknown"
        ) from e
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def check_registry(ref: Reference, policy: PullPolicy) -> bool:
    """Whether the pull may go to `ref`'s registry; True when it is a listed local one (plain
    HTTP allowed). Forbidden (403, reason registry_not_allowed) for a private address."""
    if ref.registry in policy.local:
        return True
    for addr in _addresses(ref.host):
        if not addr.is_global:
            raise errors.Forbidden(
                f"registry {ref.registry} resolves to {addr}, a non-public address; an operator "
                "lists the local registries an edge may pull from (DSEC_EDGE_PULL_LOCAL_REGISTRIES)",
                reason="registry_not_allowed",
            )
    return False


def _auth_file(d: Path, ref: Reference, auth: RegistryAuth | None) -> Path | None:
    if auth is None:
        return None
    token = base64.b64encode(f"{auth.username}:{auth.password}".encode()).decode()
    path = d / "auth.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {ref.api_registry: {"auth": token}, ref.registry: {"auth": token}}}, f)
    return path


def _skopeo(args: list[str], *, timeout: float, env: dict[str, str], progress: Progress | None) -> str:
    """Run skopeo; its output, line by line to `progress`. A failure raises what it means."""
    exe = shutil.which(SKOPEO)
    if exe is None:
        raise errors.Unavailable(
            "skopeo is not installed on this edge: run ./install.sh (it installs skopeo)"
        )

    def line(text: str) -> None:
        if progress is not None and text.strip():
            progress(text[:300])

    done = run_tool([exe, *args], env=env, timeout=timeout, on_line=line)
    if done.timed_out:
        raise errors.Unavailable(f"the pull did not finish within {timeout:.0f} s", reason="pull_timeout")
    text = "\n".join(done.tail)
    if done.returncode != 0:
        raise _pull_error(text)
    return text


def _pull_error(text: str) -> errors.DsecError:
    tail = text.strip()[-800:]
    low = text.lower()
    if "unauthorized" in low or "authentication required" in low or "denied" in low:
        return errors.Forbidden(
            f"the registry refused the pull (wrong or missing credentials?): {tail}", reason="registry_auth"
        )
    if "manifest unknown" in low or "not found" in low or "name unknown" in low:
        return errors.ImageNotFound(f"the registry has no such image: {tail}", reason="not_in_registry")
    if "digest" in low and ("mismatch" in low or "does not match" in low):
        return errors.InvalidRequest(
            f"the registry's content does not match the digest: {tail}", reason="digest_mismatch"
        )
    if (
        "no image found in manifest list for architecture" in low
        or "choosing an image from manifest list" in low
    ):
        return errors.InvalidRequest(f"the image has no linux/amd64 variant: {tail}", reason="no_platform")
    return errors.Unavailable(f"the pull failed: {tail}", reason="registry_unavailable")


def _json(raw: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise errors.InvalidRequest("the registry's manifest is not a JSON object", reason="bad_manifest")
    return doc


def _amd64(index: dict[str, Any]) -> str | None:
    """The linux/amd64 manifest's digest in an image index."""
    for d in index.get("manifests") or []:
        p = d.get("platform") if isinstance(d, dict) else None
        if isinstance(p, dict) and p.get("os") == "linux" and p.get("architecture") == "amd64":
            digest = d.get("digest")
            return (
                digest if isinstance(digest, str) and re.fullmatch(r"sha256:[a-f0-9]{64}", digest) else None
            )
    return None


def _size(manifest: dict[str, Any]) -> int:
    """The compressed size of an image manifest's layers and config."""
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        raise errors.InvalidRequest("the registry's manifest lists no layers", reason="bad_manifest")
    total = 0
    for d in [*layers, manifest.get("config") or {}]:
        size = d.get("size") if isinstance(d, dict) else None
        if isinstance(size, int) and size > 0:
            total += size
    return total


def fetch_layout(
    ref: Reference,
    d: Path,
    *,
    policy: PullPolicy,
    auth: RegistryAuth | None = None,
    progress: Progress | None = None,
) -> tuple[Path, str, int]:
    """Copy `ref` (under `policy`, see the module) into an OCI layout `d`/layout (tag
    `image`); `d` a private directory on disk. The layout, its manifest's digest and size."""
    local = check_registry(ref, policy)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(d), "TMPDIR": str(d)}
    src = [f"--src-tls-verify={'false' if local else 'true'}"]
    authfile = _auth_file(d, ref, auth)
    if authfile is not None:
        src.append(f"--src-authfile={authfile}")
    if progress is not None:
        progress(f"pulling {ref}")
    inspect = ["--tls-verify=false"] if local else []
    if authfile is not None:
        inspect.append(f"--authfile={authfile}")

    # The manifest first (an index: its linux/amd64 manifest), to refuse an image too
    # big before any layer is fetched.
    def manifest(target: str) -> dict[str, Any]:
        raw = _skopeo(
            ["--insecure-policy", "inspect", *inspect, "--raw", f"docker://{target}"],
            timeout=min(policy.timeout_s, 120), env=env, progress=None,
        )  # fmt: skip
        return _json(raw)

    doc = manifest(str(ref))
    if "layers" not in doc:
        pinned = _amd64(doc)
        if pinned is None:
            raise errors.InvalidRequest(f"{ref} has no linux/amd64 image", reason="no_platform")
        doc = manifest(f"{ref.registry}/{ref.repository}@{pinned}")
    size = _size(doc)
    if size > policy.max_bytes:
        raise errors.QuotaExceeded(
            f"{ref} is {size >> 20} MiB compressed, over this edge's pull limit of "
            f"{policy.max_bytes >> 20} MiB (DSEC_EDGE_PULL_MAX_BYTES)",
            reason="image_too_large",
        )
    layout = d / "layout"
    _skopeo(
        ["--insecure-policy", "--override-os", "linux", "--override-arch", "amd64", "copy", *src,
         "--retry-times", "2", f"docker://{ref}", f"oci:{layout}:image"],
        timeout=policy.timeout_s, env=env, progress=progress,
    )  # fmt: skip
    if authfile is not None:
        authfile.unlink()
    index = json.loads((layout / "index.json").read_text())
    return layout, index["manifests"][0]["digest"], size  # (skopeo wrote it: the manifest it verified)


def pull_image(
    store: LayerStore,
    ref: Reference,
    name: str,
    *,
    scratch: Path,
    policy: PullPolicy,
    auth: RegistryAuth | None = None,
    project: str | None = None,
    progress: Progress | None = None,
) -> Image:
    """Pull `ref` into the store as image `name` (see the module), `project`'s if given.
    `scratch`: a directory on disk for the download (it can be as big as the image)."""
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pull-", dir=scratch) as tmp:
        layout, digest, size = fetch_layout(ref, Path(tmp), policy=policy, auth=auth, progress=progress)
        image = import_oci_archive(store, name, layout, progress=progress)
    image.source.update({"type": "pull", "reference": str(ref), "digest": digest, "size_bytes": size})
    if project is not None:
        image.source["project"] = project  # its members' only (Image.usable_by)
    image.source.pop("archive", None)  # (the scratch directory, gone)
    store.put_image(image)
    return image
