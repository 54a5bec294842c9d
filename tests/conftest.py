"""Shared fixtures. Integration tests run the real thing as root and clean up."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

LAYERS = Path(os.environ.get("DSEC_TEST_LAYERS", "/var/lib/dsec/layers"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0 and shutil.which("crun"):
        return
    skip = pytest.mark.skip(reason="needs root and crun (run the README's test command)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def python_image() -> str:
    """The default `python` image in the shared test layer store (built once, ~30 s)."""
    from dsec.layers import LayerStore, build_recipe_image

    store = LayerStore(LAYERS)
    try:
        store.get_image("python")
    except Exception:
        build_recipe_image(store, "python")
    return "python"


@pytest.fixture
def edge_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    base = tmp_path_factory.mktemp("dsec-edge")
    run_dir = Path("/run") / f"dsec-test-{secrets.token_hex(4)}"  # unique across concurrent pytest runs
    yield {
        "data_dir": base / "data",
        "run_dir": run_dir,
        "layers_dir": LAYERS,
        "criu_dir": LAYERS.parent / "criu",
    }
    from dsec.isolation.procs import mounts_under, unmount_all

    for m in sorted(mounts_under(run_dir.parent), key=len, reverse=True):  # after an edge was killed
        if m == str(run_dir) or m.startswith(f"{run_dir}/"):
            unmount_all(Path(m))
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
async def edge(python_image: str, edge_dirs: dict[str, Path]) -> AsyncIterator[object]:
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    # A unique name: edges own the `<name>-*` cgroups on the host, and test runs may overlap.
    # fncall workers start on the first call, not with every test's edge.
    e = Edge(
        EdgeSettings(name="t" + secrets.token_hex(4), reconcile_interval_s=3600, fncall_image="", **edge_dirs)
    )
    await e.start()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture(params=["container", "gvisor", "microvm"])
def backend(request: pytest.FixtureRequest, edge: object) -> str:
    """Each isolation tier in turn (SandboxSpec.backend). One the edge cannot run fails the
    test (install.sh installs what each needs), unless DSEC_TEST_SKIP_ABSENT_BACKENDS=1."""
    name = str(request.param)
    if name not in edge.backends:  # type: ignore[attr-defined]
        why = edge.core.absent_backends.get(name, "not configured")  # type: ignore[attr-defined]
        if os.environ.get("DSEC_TEST_SKIP_ABSENT_BACKENDS") == "1":
            pytest.skip(f"backend {name} is not available here: {why}")
        pytest.fail(f"backend {name} is not available here: {why}")
    return name


def require(edge: object, backend: str, capability: object) -> None:
    """Skip on a backend that declares it lacks `capability` (test_backends and each
    backend's own tests check that such an operation is refused with unsupported_operation,
    naming the backend)."""
    if capability not in edge.backends[backend].capabilities:  # type: ignore[attr-defined]
        pytest.skip(f"the {backend} backend declares no {capability.value}")  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def code_image() -> str:
    """The fncall image `code` (every available language), built once (~2 min)."""
    from dsec.layers import LayerStore, build_recipe_image, load_recipe

    store = LayerStore(LAYERS)
    built = store.get_image("code").source.get("recipe_digest") if store.has_image("code") else None
    if built != load_recipe("code").digest():  # none yet, or from an older recipe (languages added)
        build_recipe_image(store, "code")
    return "code"


async def edge_restart_round_trip(
    edge_dirs: dict[str, Path], spec: object, leftovers: object, *, orphan_reaped: bool = False
) -> None:
    """An edge closed without stopping its sandboxes, and a new one on the same settings:
    a running and a paused sandbox are adopted (files, processes, pause state), a stop leaves
    nothing (`leftovers(edge, id)` lists what would be left), and an orphan (a sandbox no
    record claims, as after a crash that lost the record) is removed by the reconciler (and
    its host process reaped, where the edge is its parent: `orphan_reaped`)."""
    import asyncio
    import secrets

    from dsec.config import EdgeSettings
    from dsec.edge import Edge
    from dsec.models import ExecRequest

    async def run(e: Edge, sid: str, cmd: str) -> str:
        r = await e.exec(sid, ExecRequest(cmd=cmd, timeout=60))
        assert r.exit_code == 0, r
        return r.stdout

    left = leftovers  # (edge, sandbox id) -> list[str]
    settings = EdgeSettings(
        name="t" + secrets.token_hex(4), reconcile_interval_s=3600, fncall_image="", **edge_dirs
    )
    e = Edge(settings)
    await e.start()
    try:
        sb = await e.create(spec)  # type: ignore[arg-type]
        await run(e, sb.id, "echo kept > /root/x; sleep 600 > /dev/null 2>&1 &")
        paused = await e.create(spec)  # type: ignore[arg-type]
        await e.pause(paused.id)
        await e.close(stop_sandboxes=False)
        e = Edge(settings)
        await e.start()
        assert {sb.id, paused.id} <= set(e.sandboxes)
        assert await run(e, sb.id, "cat /root/x; pgrep -c sleep") == "kept\n1\n"
        assert e.get(paused.id).state == "paused"
        await e.resume(paused.id)
        assert await run(e, paused.id, "echo up") == "up\n"
        host_pid = e.sandboxes[sb.id].handle.pid
        await e.stop(sb.id)
        assert not Path(f"/proc/{host_pid}").exists()
        assert left(e, sb.id) == []  # type: ignore[operator]
        orphan = await e.create(spec)  # type: ignore[arg-type]
        handle = e.sandboxes[orphan.id].handle
        e._detach(e.sandboxes.pop(orphan.id))
        assert e.store is not None
        e.store.delete(orphan.id)
        await e.reconcile()
        for _ in range(100):
            if not Path(f"/proc/{handle.pid}").exists():
                break
            await asyncio.sleep(0.05)
        if orphan_reaped:
            assert not Path(f"/proc/{handle.pid}").exists()  # killed and reaped: no zombie left
        assert left(e, orphan.id) == []  # type: ignore[operator]
    finally:
        await e.close()
    assert left(e, paused.id) == []  # type: ignore[operator]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[object]:
    """A real PostgreSQL (Debian's) for the session, in a directory of its own, on a free
    port of 127.0.0.1; stopped and removed afterwards."""
    from dsec.cluster.postgres import find_bin_dir, throwaway_server

    try:
        find_bin_dir()
    except Exception as e:
        pytest.skip(f"PostgreSQL is not installed: {e}")
    with throwaway_server() as server:
        yield server


@pytest.fixture
def pg_url(postgres_server: object) -> Iterator[str]:
    """A fresh database on the session's server; dropped afterwards."""
    name = "dsec_test_" + secrets.token_hex(4)
    url = postgres_server.create_database(name)  # type: ignore[attr-defined]
    try:
        yield url
    finally:
        postgres_server.drop_database(name)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def registry_server() -> Iterator[object]:
    """A real OCI registry (Debian's docker-registry, the CNCF distribution server) for the
    session, in a directory of its own, on a free port of 127.0.0.1; stopped and removed
    afterwards. Tests use repositories of their own (`registry_url`)."""
    import tempfile

    from dsec.cluster.registry import RegistryServer, find_registry_bin, free_port

    try:
        find_registry_bin()
    except Exception as e:
        pytest.skip(f"the registry is not installed: {e}")
    root = Path(tempfile.mkdtemp(prefix="dsec-registry-", dir="/tmp"))
    os.chmod(root, 0o755)  # the docker-registry user must reach its storage
    server = RegistryServer(root / "registry", port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.remove()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def registry_url(registry_server: object) -> str:
    """The session's registry with a fresh repository (URL path = repository name)."""
    return f"{registry_server.url}/t{secrets.token_hex(4)}"  # type: ignore[attr-defined]
