"""Small real OCI images for tests, made here (no network): a layout directory with one
gzip layer holding a static shell (Debian's bash-static as /bin/sh) and the files given, and
the image config given; pushed to a registry with skopeo."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BASH_STATIC = Path("/bin/bash-static")
PASSWD = b"root:x:0:0:root:/root:/bin/sh\napp:x:1234:2345:app:/home/app:/bin/sh\n"
GROUP = b"root:x:0:\napp:x:2345:\n"


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_layout(
    layout: Path, *, config: dict[str, Any] | None = None, files: dict[str, bytes] | None = None, pad: int = 0
) -> str:
    """An OCI image layout at `layout` (tag `latest`); `pad` bytes of random data added as
    /pad (to make a big image). The manifest's digest."""
    entries: dict[str, bytes] = {"etc/passwd": PASSWD, "etc/group": GROUP, **(files or {})}
    if pad:
        entries["pad"] = os.urandom(pad)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "etc", "tmp", "work", "app", "home", "home/app"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        sh = BASH_STATIC.read_bytes()
        info = tarfile.TarInfo("bin/sh")
        info.size, info.mode = len(sh), 0o755
        tar.addfile(info, io.BytesIO(sh))
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    diff_id = "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()
    layout.mkdir(parents=True, exist_ok=True)
    layer = _blob(layout, gzip.compress(raw.getvalue(), compresslevel=1, mtime=0))
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "oci_images.make_layout"}],  # one per layer, as builders want
    }
    cfg_desc = _blob(layout, json.dumps(cfg).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg_desc},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}],
    }
    m = _blob(layout, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **m,
                "annotations": {"org.opencontainers.image.ref.name": "latest"},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return str(m["digest"])


def push(layout: Path, dest: str, *, creds: str | None = None) -> None:
    """Copy the layout's `latest` to `dest` (registry/repository:tag, plain HTTP)."""
    argv = [shutil.which("skopeo") or "skopeo", "--insecure-policy", "copy", "--dest-tls-verify=false"]
    if creds is not None:
        argv.append(f"--dest-creds={creds}")
    subprocess.run([*argv, f"oci:{layout}:latest", f"docker://{dest}"], check=True, capture_output=True)


USER, PASSWORD = "trainer", "s3cret-Pa55"
CONFIG = {"Env": ["PATH=/opt/bin:/usr/bin:/bin", "JAVA_HOME=/opt/jdk"], "WorkingDir": "/app", "User": "app"}


@contextlib.contextmanager
def auth_registry() -> Iterator[tuple[Any, dict[str, str]]]:
    """A real registry (Debian's docker-registry) that wants a login (bcrypt htpasswd:
    USER/PASSWORD) on a free port of 127.0.0.1, with `team/small:1` (CONFIG, /app/hello.txt)
    and `team/big:1` (3 MiB more) pushed; yields it and the manifest digests by name."""
    import bcrypt

    from dsec.cluster.registry import RegistryServer, free_port

    root = Path(tempfile.mkdtemp(prefix="dsec-pullreg-", dir="/tmp"))
    os.chmod(root, 0o755)
    htpasswd = root / "htpasswd"
    htpasswd.write_bytes(
        USER.encode() + b":" + bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)) + b"\n"
    )
    os.chmod(htpasswd, 0o644)
    server = RegistryServer(root / "registry", port=free_port(), htpasswd=htpasswd)
    server.start()
    try:
        host = f"127.0.0.1:{server.port}"
        digests = {"small": make_layout(root / "small", config=CONFIG, files={"app/hello.txt": b"hello\n"})}
        push(root / "small", f"{host}/team/small:1", creds=f"{USER}:{PASSWORD}")
        digests["big"] = make_layout(root / "big", pad=3 << 20)
        push(root / "big", f"{host}/team/big:1", creds=f"{USER}:{PASSWORD}")
        yield server, digests
    finally:
        server.remove()
        shutil.rmtree(root, ignore_errors=True)
