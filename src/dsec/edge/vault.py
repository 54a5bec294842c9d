"""Protected paths (graders, reference answers): moved out of a sandbox into a vault on the host,
bound read-only into verify's trusted root only.

A collaborator of `Edge` (edge.py): what it needs of the rest of the edge is passed to its
constructor."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import os
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec import errors
from dsec.backends.base import Capability
from dsec.config import EdgeSettings
from dsec.edge import trusted
from dsec.edge.execs import EdgeExec
from dsec.edge.files import SandboxFiles
from dsec.edge.gradersandbox import copy_out_of_guest
from dsec.edge.sandbox import Sandbox
from dsec.models import ExecRequest, ExecResult


class EdgeVault:
    """protect() and verify() (see the module)."""

    def __init__(
        self,
        *,
        settings: EdgeSettings,
        get: Callable[[str], Sandbox],
        execs: EdgeExec,
        misbehaviour: Callable[..., dict[str, int]],
    ) -> None:
        self.settings = settings
        self._get = get
        self._logged = execs._logged
        self._run_trusted = execs._run_trusted
        self._trusted_checks = execs._trusted_checks
        self.log_event = execs.log_event
        self._misbehaviour = misbehaviour
        self._vault_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    # --- protected paths (graders, reference answers) -------------------------------

    def _vault(self, sandbox_id: str) -> Path:
        return self.settings.data_dir / "vault" / sandbox_id

    def _vault_lock(self, sandbox_id: str) -> asyncio.Lock:
        lock = self._vault_locks.get(sandbox_id)
        if lock is None:
            lock = self._vault_locks[sandbox_id] = asyncio.Lock()
        return lock

    def _vault_index(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """The vault's entries ({path, kind d|f|l, tree, link}); an older edge's tar blobs
        become trees here, once."""
        vault = self._vault(sandbox_id)
        index_file = vault / "index.json"
        index: list[dict[str, Any]] = json.loads(index_file.read_text()) if index_file.exists() else []
        if any("kind" not in e for e in index):
            owner = trusted.trusted_host_id(self.settings.uid_offset)
            for n, e in enumerate(index):
                if "kind" not in e:
                    tree = f"t{n}"
                    shutil.rmtree(vault / tree, ignore_errors=True)
                    kind, link = trusted.convert_blob(vault / e["blob"], vault / tree, e["dir"], owner)
                    e.update(kind=kind, tree=tree, link=link)
            index_file.write_text(json.dumps(index))
        return index

    def _protected(
        self, sandbox_id: str, index: builtins.list[dict[str, Any]]
    ) -> builtins.list[trusted.Protected]:
        vault = self._vault(sandbox_id)
        out = []
        for e in index:
            src = None if e["kind"] == "l" else vault / e["tree"]
            out.append(trusted.Protected(e["path"], e["kind"], src, e["link"]))
        return out

    @staticmethod
    async def _delete_path(sb: Sandbox, path: str) -> None:
        if sb.guest is not None:
            await sb.guest.delete(path, recursive=True)
        else:
            await sb.files.run(lambda f: f.delete(path, recursive=True))

    async def protect(self, sandbox_id: str, paths: builtins.list[str]) -> builtins.list[str]:
        """Move `paths` out of the sandbox into a vault on the host (root only): the agent's
        processes cannot read what is not there. They are copied by this process, from
        descriptors that follow nothing below each path's parent; no program of the sandbox
        runs. verify() binds them read-only into its trusted root, never into the sandbox's."""
        sb = self._get(sandbox_id)
        sb.backend.require(Capability.FILES, "protected paths")
        sb.backend.require(Capability.TRUSTED_EXEC, "protected paths (only verify reads them)")
        owner = trusted.trusted_host_id(self.settings.uid_offset)
        for raw in paths:
            if not raw.startswith("/") or "\0" in raw or os.path.normpath(raw) == "/":
                raise errors.InvalidRequest(
                    f"protected path {raw!r} must be absolute and not /, e.g. /grader"
                )
        async with self._vault_lock(sandbox_id):
            vault = self._vault(sandbox_id)
            vault.mkdir(parents=True, exist_ok=True, mode=0o700)
            index_file = vault / "index.json"
            index = self._vault_index(sandbox_id)
            if len(index) + len(paths) > trusted.MAX_PROTECTED:
                raise errors.InvalidRequest(
                    f"a sandbox holds at most {trusted.MAX_PROTECTED} protected paths "
                    f"({len(index)} already); protect their common parent instead"
                )
            done = []
            for raw in paths:
                path = os.path.normpath(raw)
                tree = f"t{len(index)}"
                dest = vault / tree
                shutil.rmtree(dest, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    dest.unlink()
                try:

                    def copy(f: SandboxFiles, p: str = path, d: Path = dest) -> tuple[str, str]:
                        return trusted.copy_out(f.root_fd, p, d, owner)

                    if sb.guest is not None:  # (a microVM: no host path into its files)
                        kind, link = await copy_out_of_guest(sb, path, dest, owner)
                    else:
                        kind, link = await sb.files.run(copy)
                    for e in index:  # a path protected before, inside this one: its mount point
                        if kind == "d" and trusted.under(e["path"], path):
                            rel = e["path"][len(path) :]
                            trusted.make_mount_point(dest, rel, e["kind"], e["link"], owner)
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        dest.unlink()
                    raise
                index.append({"path": path, "kind": kind, "tree": tree, "link": link})
                index_file.write_text(json.dumps(index))
                await self._delete_path(sb, path)
                done.append(path)
        await self.log_event(sandbox_id, "protect", {"op": "protect", "paths": done}, {})
        return done

    async def verify(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        """Run the platform's verification: every agent process is killed (and its sessions
        closed), then `req` runs as a trusted exec (the image's own toolchain, the task
        directories as the agent left them, the protected paths bound read-only from the
        vault; see dsec.edge.trusted); whatever it started is killed after it."""
        sb = self._get(sandbox_id)
        sb.backend.require(Capability.TRUSTED_EXEC, "trusted exec")  # before anything is killed
        req = req.model_copy(update={"trusted": True})
        self._trusted_checks(sb, req)  # a 400 before anything is killed
        for s in list(sb.sessions.values()):
            with contextlib.suppress(Exception):
                s.close(kill=False)
        sb.sessions.clear()
        await sb.backend.kill_user_processes(sb.handle)  # nobody left to see or change anything
        action = {"op": "verify", **req.model_dump(include={"cmd", "env", "cwd", "user"})}
        if req.task_dirs is not None:
            action["task_dirs"] = req.task_dirs

        async def run() -> dict[str, Any]:
            async with self._vault_lock(sandbox_id):
                # The mount points of the protected paths are the trusted command's own (see
                # dsec.edge.trusted): nothing is written into the agent's tree, whose space
                # (inodes included) the agent may have used up.
                protected = self._protected(sandbox_id, self._vault_index(sandbox_id))
                try:
                    raw = await self._run_trusted(sb, req, protected=protected)
                finally:
                    await sb.backend.kill_user_processes(sb.handle)  # nothing the verifier started stays
            result = raw.to_exec_result()
            result.misbehaviour = self._misbehaviour(sb, raw)
            return result.model_dump()

        obs, seq, replayed = await self._logged(sb, "verify", action, req.step, run)
        return ExecResult.model_validate({**obs, "seq": seq, "replayed": replayed})
