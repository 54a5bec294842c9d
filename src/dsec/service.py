"""Assembling processes: `dsec up` (apiserver + local edge), `dsec apiserver`, `dsec edge`."""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import socket
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from dsec.apiserver.app import create_api_app
from dsec.apiserver.tenancy import ApiServerSettings
from dsec.cluster.providers import make_provider
from dsec.config import EdgeSettings
from dsec.edge import Edge
from dsec.edge.local import LocalEdge
from dsec.edge.server import create_edge_app
from dsec.iam import IAM
from dsec.privatefs import seal_data_dir

log = logging.getLogger("dsec.service")


def default_client_config() -> Path:
    return Path(os.environ.get("DSEC_CONFIG", Path.home() / ".config" / "dsec" / "config.json"))


def _secret_file(path: Path, make: str | None = None) -> str:
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make or "dsec_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def admin_token(iam: IAM, data_dir: Path) -> str:
    """The admin token, kept in <data_dir>/admin-token (0600); re-issued if that file was lost."""
    path = data_dir / "admin-token"
    created = iam.bootstrap()
    if created is not None:
        path.unlink(missing_ok=True)
        return _secret_file(path, created)
    if path.exists():
        return path.read_text().strip()
    admin = next(p for p in iam.list_principals() if p.admin and p.name == "admin")
    return _secret_file(path, iam.rotate_token(admin.id))


def write_client_config(url: str, token: str, path: Path | None = None) -> Path:
    path = path or default_client_config()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
    os.replace(tmp, path)
    return path


def up_app(
    data_dir: Path,
    url: str,
    *,
    keep_sandboxes: bool = False,
    edge_settings: EdgeSettings | None = None,
    build_default: bool = True,
) -> tuple[FastAPI, str]:
    """An apiserver with an in-process edge and an embedded SQLite IAM: what `dsec up` serves."""
    seal_data_dir(data_dir)  # 0700, its files 0600 (an older install is fixed here)
    settings = edge_settings or EdgeSettings(data_dir=data_dir)
    iam = IAM(data_dir / "iam.db")
    token = admin_token(iam, data_dir)
    cluster = _secret_file(data_dir / "cluster-token")
    edge = Edge(settings)

    async def start() -> None:
        if build_default:
            _ensure_default_image(edge)
        await edge.start()

    async def stop() -> None:
        await edge.close(stop_sandboxes=not keep_sandboxes)
        iam.close()

    app = create_api_app(
        iam=iam,
        cluster_token=cluster,
        local_edges=[LocalEdge(edge, url)],
        extra_lifespan=start,
        on_shutdown=stop,
    )
    return app, token


def _ensure_default_image(edge: Edge) -> None:
    from dsec import errors
    from dsec.layers import build_recipe_image

    try:
        edge.layers.get_image(edge.settings.default_image)
    except errors.ImageNotFound:
        log.warning("building the default image %r (first start only, ~30 s)", edge.settings.default_image)
        build_recipe_image(edge.layers, edge.settings.default_image)


def serve(app: FastAPI, host: str, port: int, log_level: str = "warning") -> None:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
        # Longer than clients keep idle connections (httpx: 5 s), so a client never reuses a
        # connection the server is closing at that moment (a spurious ReadError).
        timeout_keep_alive=75,
    )
    # What importing and assembling made lives as long as the process: out of the collector's
    # reach, a full collection scans only what requests make (~89,000 objects at startup, a
    # 15-19 ms pause each time, bench_control_plane's apiserver over 1,000 fake edges).
    gc.freeze()
    uvicorn.Server(config).run()


def apiserver_app(data_dir: Path, edges: dict[str, str], database: str | None = None) -> FastAPI:
    """An apiserver: its IAM in `database` (a PostgreSQL URL several apiservers share), else
    in SQLite under `data_dir` (one host)."""
    seal_data_dir(data_dir)
    if database is None:
        iam = IAM(data_dir / "iam.db")
        admin_token(iam, data_dir)
    else:
        iam = IAM(database)
        created = iam.bootstrap()  # the first apiserver on a new database issues it, once
        if created is not None:
            (data_dir / "admin-token").unlink(missing_ok=True)
            _secret_file(data_dir / "admin-token", created)
            log.warning("issued the admin token: %s", data_dir / "admin-token")
    cluster = os.environ.get("DSEC_CLUSTER_TOKEN") or _secret_file(data_dir / "cluster-token")
    settings = ApiServerSettings()
    return create_api_app(
        iam=iam,
        cluster_token=cluster,
        remote_edges=edges,
        compat_auth=os.environ.get("DSEC_COMPAT_AUTH", "1") != "0",
        settings=settings,
        provider=make_provider(settings.node_provider, settings.cluster_dir),
    )


def edge_app(
    settings: EdgeSettings, public_url: str, apiservers: list[str], token: str, keep_sandboxes: bool = True
) -> FastAPI:
    return create_edge_app(
        settings, token=token, public_url=public_url, apiservers=apiservers, keep_sandboxes=keep_sandboxes
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
