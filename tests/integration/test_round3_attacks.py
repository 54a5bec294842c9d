"""Round three's attack review (issue #25) on real components: what the first round's tests
of items 1, 2, 7 and 9 did not try, as a hostile sandbox process or tenant."""

from __future__ import annotations

import pytest

from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


# --- item 2: files on the host that a sandbox can write into ---------------------------------


async def test_a_guest_cannot_grow_its_console_file_on_the_host(edge):
    """ATTACK (worked): a microVM's serial console is a file of the edge's run tmpfs (host
    memory), written by QEMU, and the guest kernel printed a line there for every OOM kill
    ("Out of memory: Killed process ...", KERN_ERR): a sandbox looping on allocations grew it
    by ~160 bytes each, without bound, for as long as it lived. The guest kernel now prints
    only critical messages (its panic, the agent's last words) to the console."""
    sb = await edge.create(SandboxSpec(image="python", backend="microvm", memory_mb=64))
    console = edge.backends["microvm"].vms_dir / sb.id / "console.log"
    before = console.stat().st_size
    cmd = "for i in 1 2 3; do python3 -c 'b = bytearray(200 << 20)'; echo $?; done"
    r = await edge.exec(sb.id, ExecRequest(cmd=cmd, timeout=300))
    assert r.stdout.split() == ["137"] * 3  # each one killed by the guest's OOM killer
    assert console.stat().st_size == before, console.read_text(errors="replace")[-500:]


# --- item 1: names a sandbox made, through the HTTP API ---------------------------------------


async def test_a_file_name_that_is_not_utf8_does_not_break_the_trainers_listing(edge, tmp_path):
    """ATTACK (worked): the agent names a file of /work with a byte that is not UTF-8 (any
    byte but '/' and NUL is a name): the trainer's listing of /work failed with a 500 (the
    name, decoded with surrogate escapes, cannot be written as JSON), on every backend (a
    microVM's find prints the same). Such a byte is now shown as U+FFFD, as in exec output."""
    import httpx

    from dsec.apiserver.app import create_api_app
    from dsec.edge.local import LocalEdge
    from dsec.iam import IAM

    iam = IAM(tmp_path / "iam.db")
    admin = iam.bootstrap()
    app = create_api_app(iam=iam, cluster_token="c", local_edges=[LocalEdge(edge, "http://local")])
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            auth = {"Authorization": f"Bearer {admin}"}
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=auth) as c:
                sid = (await c.post("/v1/sandboxes", json={"image": "python"})).json()["id"]
                try:
                    cmd = "touch /work/ok /work/$(printf 'bad\\377name')"
                    r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
                    assert r.json()["exit_code"] == 0, r.text
                    r = await c.get(f"/v1/sandboxes/{sid}/files/list", params={"path": "/work"})
                    assert r.status_code == 200, r.text
                    names = {e["name"]: e["path"] for e in r.json()["entries"]}
                    assert names == {"bad\ufffdname": "/work/bad\ufffdname", "ok": "/work/ok"}
                finally:
                    await c.delete(f"/v1/sandboxes/{sid}")
    finally:
        iam.close()
