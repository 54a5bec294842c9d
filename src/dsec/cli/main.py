"""`dsec`: start the service, manage images, drive sandboxes. A thin layer over the SDK."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from dsec import errors
from dsec.cli.plan_cmd import plan_command

app = typer.Typer(help="dsec: elastic sandboxes for agentic RL.", no_args_is_help=True, add_completion=False)
image_app = typer.Typer(
    help="Build, import and list images (on this machine's layer store).", no_args_is_help=True
)
sandbox_app = typer.Typer(help="Create, list, run in and remove sandboxes.", no_args_is_help=True)
token_app = typer.Typer(
    help="Rotate or revoke API tokens (a leaked one, a departing user's).", no_args_is_help=True
)
cluster_app = typer.Typer(
    help="A whole cluster on this machine: PostgreSQL, apiservers, edges in network namespaces.",
    no_args_is_help=True,
)
app.add_typer(cluster_app, name="cluster")
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(token_app, name="token")
console = Console()
err_console = Console(stderr=True)

DataDir = Annotated[
    Path, typer.Option("--data-dir", envvar="DSEC_DATA_DIR", help="state: layers, IAM, records")
]
JsonOut = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _fail(e: errors.DsecError) -> None:
    err_console.print(f"[red]error[/red] ({e.code}): {e.message}")
    raise typer.Exit(2)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )


@app.command()
def up(
    host: str = "127.0.0.1",
    port: int = 8420,
    data_dir: DataDir = Path("/var/lib/dsec"),
    keep_sandboxes: Annotated[bool, typer.Option(help="leave sandboxes running at shutdown")] = False,
    verbose: bool = False,
) -> None:
    """Run an apiserver and a local edge with an embedded SQLite store."""
    from dsec.config import EdgeSettings
    from dsec.service import serve, up_app, write_client_config

    _logging(verbose)
    url = f"http://{host}:{port}"
    settings = EdgeSettings(data_dir=data_dir)
    application, token = up_app(data_dir, url, keep_sandboxes=keep_sandboxes, edge_settings=settings)
    cfg = write_client_config(url, token)
    console.print(f"[bold green]dsec[/bold green] serving at [bold]{url}[/bold]  (API docs: {url}/docs)")
    console.print(f"admin token: {data_dir / 'admin-token'}; client config: {cfg}")
    serve(application, host, port)


@app.command()
def apiserver(
    host: str = "127.0.0.1",
    port: int = 8420,
    data_dir: DataDir = Path("/var/lib/dsec"),
    edge: Annotated[
        list[str], typer.Option(help="a static edge as name=url (edges also self-register)")
    ] = [],  # noqa: B006
    database: Annotated[
        str | None,
        typer.Option(
            envvar="DSEC_DATABASE",
            help="PostgreSQL URL shared by every apiserver (postgresql://user:pw@host/db); "
            "default: SQLite in the data dir (one apiserver)",
        ),
    ] = None,
    verbose: bool = False,
) -> None:
    """Run an apiserver only; edges register with it. Stateless with --database: run as
    many as you like behind one name, against one PostgreSQL."""
    from dsec.service import apiserver_app, serve

    _logging(verbose)
    edges = dict(e.split("=", 1) for e in edge)
    serve(apiserver_app(data_dir, edges, database), host, port)


ClusterDir = Annotated[
    Path, typer.Option("--dir", envvar="DSEC_CLUSTER_DIR", help="where the cluster keeps its state")
]


@cluster_app.command("up")
def cluster_up(
    apiservers: Annotated[int, typer.Option(help="apiserver processes (on one PostgreSQL)")] = 1,
    edges: Annotated[int, typer.Option(help="edges, each in a network namespace of its own")] = 1,
    directory: ClusterDir = Path("/var/lib/dsec/cluster"),
    seed_layers: Annotated[
        Path, typer.Option(help="the layer store every edge's own starts as (hard links)")
    ] = Path("/var/lib/dsec/layers"),
    elastic: Annotated[
        bool, typer.Option(help="the apiservers add edges for announced bursts (node provider: local)")
    ] = False,
    idle_drain_after: Annotated[
        float | None, typer.Option(help="with --elastic: release edges idle this many seconds")
    ] = None,
    json_out: JsonOut = False,
) -> None:
    """Start PostgreSQL, an OCI registry, N apiservers and M edges (each a host of its own:
    network namespace, address, data directory); `dsec cluster down` removes them."""
    from dsec.cluster import local

    env = {"DSEC_APISERVER_NODE_PROVIDER": "local"} if elastic else {}
    if elastic and idle_drain_after is not None:
        env["DSEC_APISERVER_IDLE_DRAIN_AFTER_S"] = str(idle_drain_after)
    try:
        state = local.up(directory, apiservers=apiservers, edges=edges, seed_layers=seed_layers, env=env)
    except errors.DsecError as e:
        _fail(e)
        return
    if json_out:
        print(json.dumps(state.public()))
        return
    table = Table("process", "pid", "address")
    for a in state.apiservers:
        table.add_row(a.name, str(a.pid), a.url)
    for m in state.edges:
        table.add_row(f"{m.name} ({m.netns})", str(m.pid), m.url)
    console.print(table)
    console.print(f"DSEC_URL={','.join(a.url for a in state.apiservers)}")
    console.print(f"DSEC_TOKEN={state.token}")


@cluster_app.command("down")
def cluster_down(
    directory: ClusterDir = Path("/var/lib/dsec/cluster"),
    purge: Annotated[bool, typer.Option(help="also remove its data (databases, layer stores)")] = False,
) -> None:
    """Stop and remove everything `dsec cluster up` made."""
    from dsec.cluster import local

    try:
        local.down(directory, purge=purge)
    except errors.DsecError as e:
        _fail(e)


@cluster_app.command("env")
def cluster_env(directory: ClusterDir = Path("/var/lib/dsec/cluster")) -> None:
    """Print `export DSEC_URL=... DSEC_TOKEN=...` for the running cluster (every apiserver,
    the admin token): `eval "$(dsec cluster env)"` points the SDK and the CLI at it."""
    import shlex

    from dsec.cluster import local

    try:
        state = local.ClusterState.load(directory)
    except errors.DsecError as e:
        _fail(e)
    urls = ",".join(a.url for a in state.apiservers)
    print(f"export DSEC_URL={shlex.quote(urls)} DSEC_TOKEN={shlex.quote(state.token)}")


@cluster_app.command("add-edge")
def cluster_add_edge(
    count: Annotated[int, typer.Option("--count", "-n", help="edges to add")] = 1,
    directory: ClusterDir = Path("/var/lib/dsec/cluster"),
    json_out: JsonOut = False,
) -> None:
    """Add edges to a running `dsec cluster up` cluster (each in a namespace of its own)."""
    from dsec.cluster import local

    try:
        added = local.add_edge(directory, count, wait_s=120)
    except errors.DsecError as e:
        _fail(e)
        return
    out = [{"name": m.name, "pid": m.pid, "netns": m.netns, "address": m.address} for m in added]
    if json_out:
        print(json.dumps({"edges": out}))
        return
    for m in out:
        console.print(f"{m['name']} ({m['netns']}, {m['address']}), pid {m['pid']}")


@cluster_app.command("remove-edge")
def cluster_remove_edge(
    edge: Annotated[str, typer.Argument(help="the edge's name")],
    directory: ClusterDir = Path("/var/lib/dsec/cluster"),
) -> None:
    """Stop an edge of the cluster (its sandboxes stop too) and remove its namespace and data;
    drain it first (`dsec edge drain`) and wait for its sandboxes to end, for a gentle removal."""
    from dsec.cluster import local

    try:
        if not local.remove_edge(directory, edge):
            raise errors.NotFound(f"the cluster in {directory} has no edge {edge!r}")
    except errors.DsecError as e:
        _fail(e)


edge_app = typer.Typer(
    help="Run a node agent (`dsec edge --apiserver URL ...`), or drain and undrain edges.",
    invoke_without_command=True,
)
app.add_typer(edge_app, name="edge")


@edge_app.callback()
def edge_cmd(
    ctx: typer.Context,
    apiserver: Annotated[
        list[str] | None, typer.Option(help="apiserver URL to register with (repeatable)")
    ] = None,
    name: str = "n1",
    host: str = "127.0.0.1",
    port: int = 8421,
    url: Annotated[str | None, typer.Option(help="URL apiservers use to reach this edge")] = None,
    data_dir: DataDir = Path("/var/lib/dsec"),
    run_dir: Path = Path("/run/dsec"),
    token: Annotated[str | None, typer.Option(envvar="DSEC_CLUSTER_TOKEN", help="cluster token")] = None,
    max_sandboxes: Annotated[int, typer.Option(envvar="DSEC_EDGE_MAX_SANDBOXES")] = 4000,
    keep_sandboxes: Annotated[bool, typer.Option(help="leave sandboxes running at shutdown")] = True,
    verbose: bool = False,
) -> None:
    """Run a node agent that registers with apiservers (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    if not apiserver:
        raise typer.BadParameter("give the apiservers to register with", param_hint="--apiserver")
    from dsec.config import EdgeSettings
    from dsec.service import edge_app as make_edge_app
    from dsec.service import serve

    _logging(verbose)
    cluster = token or (data_dir / "cluster-token").read_text().strip()
    settings = EdgeSettings(name=name, data_dir=data_dir, run_dir=run_dir, max_sandboxes=max_sandboxes)
    serve(
        make_edge_app(settings, url or f"http://{host}:{port}", apiserver, cluster, keep_sandboxes),
        host,
        port,
    )


@edge_app.command("drain")
def edge_drain(edge: Annotated[str, typer.Argument(help="the edge's name (dsec status)")]) -> None:
    """No new placements on EDGE (maintenance); its sandboxes keep working. Admins only."""
    with _client() as c:
        c.drain_edge(edge)
    err_console.print(f"edge {edge} is draining: no new placements; its sandboxes keep working")


@edge_app.command("undrain")
def edge_undrain(edge: Annotated[str, typer.Argument(help="the edge's name")]) -> None:
    """EDGE takes placements again. Admins only."""
    with _client() as c:
        c.undrain_edge(edge)
    err_console.print(f"edge {edge} takes placements again")


# --- images ----------------------------------------------------------------------------


def _store(data_dir: Path) -> Any:
    """The layer store `dsec up` serves with this data dir: DSEC_EDGE_LAYERS_DIR, else
    <data-dir>/layers (an image built elsewhere would be one `dsec up` cannot find)."""
    from dsec.config import EdgeSettings
    from dsec.layers import LayerStore

    return LayerStore(EdgeSettings(data_dir=data_dir).layer_root)


PulledName = Annotated[
    str | None, typer.Option(help="the image's name (default: the reference's last part and tag)")
]
PullProject = Annotated[str | None, typer.Option(help="pull into this project's images, with its logins")]


@image_app.command("build")
def image_build(
    recipe: Annotated[
        str, typer.Argument(help="a Debian recipe (code, python), or with -t a build context directory")
    ],
    tag: Annotated[
        str | None, typer.Option("-t", "--tag", help="build a Dockerfile, through the service, as this image")
    ] = None,
    file: Annotated[
        str, typer.Option("-f", "--file", help="the Dockerfile's path in the context")
    ] = "Dockerfile",
    project: PullProject = None,
    build_arg: Annotated[list[str], typer.Option("--build-arg", help="ARG=value")] = [],  # noqa: B006
    target: Annotated[str | None, typer.Option(help="the stage to build")] = None,
    data_dir: DataDir = Path("/var/lib/dsec"),
    quiet: bool = False,
    as_json: JsonOut = False,
) -> None:
    """Build an image: `dsec image build -t NAME[:TAG] [-f Dockerfile] [--project P] CONTEXT` builds
    a Dockerfile through the service (the context directory is uploaded; its log streams
    here); `dsec image build RECIPE` a Debian recipe into this machine's layer store (cached
    by recipe digest)."""
    if tag is not None:
        args = dict(a.partition("=")[::2] for a in build_arg)
        with _client() as c:
            image = c.build_image(
                recipe, tag, project=project, dockerfile=file, target=target, build_args=args,
                on_log=None if quiet or as_json else err_console.print,
            )  # fmt: skip
        if as_json:
            print(json.dumps(image))
        elif not quiet:
            console.print(f"image [bold]{image['name']}[/bold] ({image.get('digest')})")
        return
    from dsec.layers import build_recipe_image

    store = _store(data_dir)
    try:
        if quiet or as_json:
            image_ = build_recipe_image(store, recipe)
        else:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=err_console) as bar:
                task = bar.add_task(f"building {recipe}", total=None)
                image_ = build_recipe_image(
                    store, recipe, progress=lambda m: bar.update(task, description=f"{recipe}: {m}")
                )
    except errors.DsecError as e:
        _fail(e)
    if as_json:
        print(image_.model_dump_json())
    elif not quiet:
        console.print(f"image [bold]{image_.name}[/bold]: {', '.join(str(r) for r in image_.layers)}")


@image_app.command("import")
def image_import(
    name: str, archive: Path, data_dir: DataDir = Path("/var/lib/dsec"), as_json: JsonOut = False
) -> None:
    """Import a `docker save` tar or an OCI layout (directory or tar) as an image."""
    from dsec.layers import import_oci_archive

    try:
        image = import_oci_archive(_store(data_dir), name, archive)
    except errors.DsecError as e:
        _fail(e)
    if as_json:
        print(image.model_dump_json())
    else:
        console.print(f"imported {name}: {len(image.layers)} layers")


@image_app.command("push")
def image_push(
    name: str,
    registry: Annotated[
        str,
        typer.Option(
            "--registry",
            envvar="DSEC_EDGE_REGISTRY",
            help="http(s)://host:port[/repository] (repository `dsec` without a path)",
        ),
    ],
    data_dir: DataDir = Path("/var/lib/dsec"),
    as_json: JsonOut = False,
) -> None:
    """Push an image from the layer store to an OCI registry: each layer a blob (uploaded once),
    the image a manifest tagged with its name. Edges with that registry pull it at first use."""
    import asyncio

    from dsec.layers import distribution

    store = _store(data_dir)

    async def push() -> tuple[str, dict[str, int]]:
        client = distribution.RegistryClient(registry)
        try:
            digest = await distribution.push_image(store, client, name)
            return digest, dict(client.counts)
        finally:
            await client.aclose()

    try:
        digest, counts = asyncio.run(push())
    except errors.DsecError as e:
        _fail(e)
    image = store.get_image(name)
    tag = distribution.image_tag(name)
    if as_json:
        out: dict[str, Any] = {"image": name, "registry": registry, "tag": tag, "manifest": digest}
        out |= {"layers": [str(r) for r in image.layers], "uploaded": counts.get("PUT blob", 0)}
        print(json.dumps(out))
    else:
        console.print(
            f"pushed {name} to {registry} as {tag} ({digest}): {len(image.layers)} layers, "
            f"{counts.get('PUT blob', 0)} blobs uploaded"
        )


@image_app.command("pull")
def image_pull(
    reference: str,
    name: PulledName = None,
    project: PullProject = None,
    as_json: JsonOut = False,
) -> None:
    """Pull an image by reference from an OCI registry onto every edge, through the service
    (DSEC_URL / DSEC_TOKEN): docker.io/library/python:3.12-slim, ghcr.io/org/x:1, host:5000/x@sha256:..."""
    with _client() as c:
        image = c.pull_image(reference, name=name, project=project)
    if as_json:
        print(json.dumps(image))
    else:
        src = image.get("source") or {}
        console.print(
            f"pulled {src.get('reference')} as {image['name']} ({src.get('digest')}): "
            f"{len(image['layers'])} layers"
        )


@image_app.command("login")
def image_login(
    registry: str,
    project: Annotated[str, typer.Option(help="the project whose pulls present this login")],
    username: Annotated[str, typer.Option(prompt=True)],
    password: Annotated[str, typer.Option(prompt=True, hide_input=True, envvar="DSEC_REGISTRY_PASSWORD")],
) -> None:
    """Keep a project's login to a registry (host[:port]) for its pulls; never shown back."""
    with _client() as c:
        c.set_registry_login(project, registry, username, password)
    console.print(f"{project}: login to {registry} as {username} kept")


LocalStore = Annotated[
    Path | None,
    typer.Option("--data-dir", help="read this machine's layer store instead of asking the service"),
]


@image_app.command("ls")
def image_ls(data_dir: LocalStore = None, as_json: JsonOut = False) -> None:
    """List the images you may use (through the service: DSEC_URL / DSEC_TOKEN), with their
    digests and config."""
    if data_dir is not None:
        images = [i.model_dump(mode="json") for i in _store(data_dir).list_images()]
    else:
        with _client() as c:
            images = c.images()
    if as_json:
        print(json.dumps(images))
        return
    t = Table("image", "digest", "layers", "workdir", "user", "env")
    for i in images:
        c = i.get("config") or {}
        digest = (i.get("digest") or "")[:19]
        t.add_row(
            i["name"],
            digest,
            str(len(i["layers"])),
            c.get("workdir") or "",
            c.get("user") or "",
            str(len(c.get("env") or {})),
        )
    console.print(t)


@image_app.command("inspect")
def image_inspect(name: str, data_dir: LocalStore = None) -> None:
    """An image as JSON: its digest (`NAME@DIGEST` pins this content), layers, where it came
    from, and its config (ENV, WORKDIR, USER, ENTRYPOINT/CMD, exposed ports, labels)."""
    if data_dir is not None:
        try:
            print(_store(data_dir).get_image(name).model_dump_json(indent=2))
        except errors.DsecError as e:
            _fail(e)
        return
    with _client() as c:
        print(json.dumps(c.image(name), indent=2))


@image_app.command("rm")
def image_rm(name: str) -> None:
    """Delete an image (a project's `<project>/<name>` by its members, a shared one by admins)
    on every edge, with its pins; running sandboxes keep theirs."""
    with _client() as c:
        c.delete_image(name)
    console.print(f"deleted {name}")


# --- sandboxes -----------------------------------------------------------------------------


@contextlib.contextmanager
def _client() -> Iterator[Any]:
    """The SDK's client from the CLI's config; an error the service answers ends the command
    with its code and message (exit 2)."""
    from dsec.client import Client

    try:
        with Client() as c:
            yield c
    except errors.DsecError as e:
        _fail(e)


@sandbox_app.command("create")
def sandbox_create(
    image: str = "python",
    count: int = 1,
    cpu: float = 1.0,
    memory_mb: int = 1024,
    ttl_idle_s: float | None = None,
    project: str = "default",
    label: Annotated[list[str], typer.Option(help="key=value")] = [],  # noqa: B006
    as_json: JsonOut = False,
) -> None:
    """Create one or a batch of sandboxes."""
    labels = dict(x.split("=", 1) for x in label)
    kw = {"cpu": cpu, "memory_mb": memory_mb, "ttl_idle_s": ttl_idle_s, "project": project, "labels": labels}
    with _client() as c:
        if count == 1:
            sbs = [c.create(image, **kw)]
        else:
            sbs = []
            with Progress(
                TextColumn("creating"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                console=err_console,
                disable=as_json,
            ) as bar:
                task = bar.add_task("create", total=count)
                for start in range(0, count, 64):
                    n = min(64, count - start)
                    sbs += c.create_many(n, image, **kw)
                    bar.advance(task, n)
    if as_json:
        print(json.dumps([s.id for s in sbs]))
    else:
        for s in sbs:
            console.print(s.id)


@sandbox_app.command("ls")
def sandbox_ls(project: str | None = None, as_json: JsonOut = False) -> None:
    """List your sandboxes."""
    with _client() as c:
        infos = c.list(project=project)
    if as_json:
        print(json.dumps([i.model_dump(mode="json") for i in infos]))
        return
    t = Table("id", "image", "state", "project", "cpu", "memory_mb")
    for i in infos:
        t.add_row(i.id, i.spec.image, i.state, i.spec.project, str(i.spec.cpu), str(i.spec.memory_mb))
    console.print(t)


@sandbox_app.command("exec")
def sandbox_exec(
    sandbox_id: str, command: list[str], timeout: float = 60.0, as_json: JsonOut = False
) -> None:
    """Run a command (one argument: a shell string; several: an argv, after `--` if a word
    starts with `-`). The exit code is the command's."""
    cmd: str | list[str] = command[0] if len(command) == 1 else command
    with _client() as c:
        r = c.sandbox(sandbox_id).exec(cmd, timeout=timeout)
    if as_json:
        print(r.model_dump_json())
        return
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    raise typer.Exit(r.exit_code)


@sandbox_app.command("shell")
def sandbox_shell(sandbox_id: str) -> None:
    """An interactive line-by-line bash session in a sandbox (state kept between lines)."""
    with _client() as c:
        session = c.sandbox(sandbox_id).session("bash")
        while True:
            try:
                line = input(f"{sandbox_id}$ ")
            except EOFError:
                break
            if not line.strip():
                continue
            r = session.run(line, timeout=600)
            sys.stdout.write(r.output)
        session.close()


@sandbox_app.command("rm")
def sandbox_rm(sandbox_ids: list[str]) -> None:
    """Stop and remove sandboxes."""
    with _client() as c:
        c.stop_many(sandbox_ids)


# --- tokens ----------------------------------------------------------------------------------

Who = Annotated[
    str | None,
    typer.Argument(help="a principal's name or id (admins only); default: your own token"),
]


def _save_own_token(token: str) -> Path | None:
    """Put a rotated own token where the SDK found the old one: the config file, unless the
    token came from DSEC_TOKEN (then the caller must update that)."""
    from dsec.client.config import config_path

    if os.environ.get("DSEC_TOKEN"):
        return None
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    data["token"] = token
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


@token_app.command("rotate")
def token_rotate(principal: Who = None, as_json: JsonOut = False) -> None:
    """Issue a new token; the old one stops working at once. Your own token (no PRINCIPAL) is
    also written to the client config file it came from."""
    with _client() as c:
        token = c.rotate_token(principal)
    saved = _save_own_token(token) if principal is None else None
    if as_json:
        print(json.dumps({"principal": principal, "token": token, "config": str(saved) if saved else None}))
        return
    print(token)
    if saved is not None:
        err_console.print(f"the new token is in {saved}")
    elif principal is None:
        err_console.print("update DSEC_TOKEN: the old token no longer works")


@token_app.command("revoke")
def token_revoke(principal: Who = None) -> None:
    """Revoke a token at once: PRINCIPAL's (admins only) or your own. An admin can issue a new
    one with `dsec token rotate PRINCIPAL`."""
    with _client() as c:
        c.revoke_token(principal)
    err_console.print(f"revoked the token of {principal or 'this client'}")


@app.command()
def status(as_json: JsonOut = False) -> None:
    """Health of the service and its edges."""
    with _client() as c:
        health = c.health()
        edges = c.edges()
    if as_json:
        print(json.dumps({"health": health, "edges": [ed.model_dump(mode="json") for ed in edges]}))
        return
    console.print(f"service: {health.get('status')}  edges healthy: {health.get('edges')}")
    t = Table("edge", "sandboxes", "pooled", "cpu used", "memory used (MB)", "images")
    for ed in edges:
        t.add_row(
            ed.name + (" (draining)" if ed.draining else ""),
            str(ed.sandboxes),
            str(int(ed.used.get("pooled", 0))),
            f"{ed.used.get('cpu', 0):g}",
            str(int(ed.used.get("memory_mb", 0))),
            ", ".join(ed.images),
        )
    console.print(t)


app.command("plan")(plan_command)


def main() -> None:  # pragma: no cover - console entry point
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
