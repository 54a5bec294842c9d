"""An OCI registry of our own: Debian's `docker-registry` (the CNCF distribution server,
2.8), a config file and a filesystem storage directory we made, listening on one address,
run as the `docker-registry` system user where it exists (root otherwise). What the tests
and a local trial run layers through (`DSEC_EDGE_REGISTRY`); a production cluster points
its edges at its own registry instead.

No authentication by default (a local trial on 127.0.0.1 or a cluster bridge); `htpasswd`
is optional (a bcrypt file made with `htpasswd -B`, which apache2-utils provides)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
from pathlib import Path

from dsec.cluster.process import ServerProcess
from dsec.errors import InvalidRequest, Unavailable

REGISTRY_BIN = Path("/usr/bin/docker-registry")
REGISTRY_USER = "docker-registry"


def find_registry_bin() -> Path:
    if not REGISTRY_BIN.exists():
        raise Unavailable(
            "the OCI registry is not installed: run ./install.sh (it installs Debian's docker-registry)"
        )
    return REGISTRY_BIN


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RegistryServer(ServerProcess):
    """One registry over `root` (its blobs in root/storage, its config in root/config.yml,
    its log in root/registry.log); the storage is kept across restarts, `remove` deletes it."""

    def __init__(
        self, root: Path, *, host: str = "127.0.0.1", port: int = 5000, htpasswd: Path | None = None
    ) -> None:
        super().__init__()
        self.root = Path(root).absolute()
        self.host = host
        self.port = port
        self.htpasswd = htpasswd
        self.bin = find_registry_bin()
        self.storage = self.root / "storage"
        self.config = self.root / "config.yml"
        self.log_path = self.root / "registry.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @staticmethod
    def _ids() -> tuple[int, int] | None:
        try:
            pw = pwd.getpwnam(REGISTRY_USER)
        except KeyError:
            return None
        return pw.pw_uid, pw.pw_gid

    def _write_config(self) -> None:
        # YAML is a superset of JSON: the config is written as JSON, no YAML library needed.
        cfg: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {"addr": f"{self.host}:{self.port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
        }
        if self.htpasswd is not None:
            cfg["auth"] = {"htpasswd": {"realm": "dsec", "path": str(self.htpasswd)}}
        self.config.write_text(json.dumps(cfg, indent=2) + "\n")
        os.chmod(self.config, 0o644)

    def start(self, timeout: float = 30.0) -> None:
        self.root.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.storage.mkdir(mode=0o700, exist_ok=True)
        ids = self._ids()
        if ids is not None:
            for parent in [self.root, *self.root.parents]:
                st = parent.stat()
                if not st.st_mode & 0o001 and st.st_uid != ids[0]:
                    raise InvalidRequest(
                        f"the registry (user {REGISTRY_USER}) cannot reach {self.root}: {parent} is "
                        f"closed to it (mode {oct(st.st_mode & 0o777)}); use a directory others may traverse"
                    )
            os.chown(self.storage, *ids)
        self._write_config()
        self._spawn([str(self.bin), "serve", str(self.config)], self.log_path, ids)
        self._wait_ready(f"the registry ({self.url})", self.log_path, timeout)

    def ready(self) -> bool:
        import httpx

        try:
            r = httpx.get(f"{self.url}/v2/", timeout=1.0)
        except httpx.HTTPError:
            return False
        return r.status_code in (200, 401)

    def requests(self, method: str, path_part: str) -> int:
        """How many requests the access log shows with this method and a path containing
        `path_part` (what the tests count downloads with)."""
        n = 0
        for line in self.log_path.read_text(errors="replace").splitlines():
            if f'"{method} ' in line and path_part in line and "HTTP/1" in line:
                n += 1
        return n

    def blob_path(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob's bytes (for tests that corrupt one)."""
        algo, _, hexd = digest.partition(":")
        return self.storage / "docker/registry/v2/blobs" / algo / hexd[:2] / hexd / "data"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
