"""The edge's side of the registry (`EdgeSettings.registry`): images pulled on first use,
snapshots pushed when made, pulled layers kept under a disk budget.

- `using(image)`: what a create holds while it runs. When the store lacks the image, its
  manifest is read from the registry and the missing layers pulled, each blob's sha256
  checked while it streams and the unpacked tree's digest before it is committed
  (`dsec.layers.distribution`). Concurrent creates share one pull: one future per image and
  one per layer blob, so 50 creates wanting one layer cause one download. The image stays
  pinned (never evicted) until the create is done.
- `publish(image)`: push an image (a snapshot) so any edge can restore it; `unpublish`
  deletes a snapshot's manifest there (by digest, owner checked) when it is deleted.
- Eviction: layers pulled from the registry (source type ``registry``) count against
  `registry_cache_mb`; past it the least recently used go first, with the pulled images
  that name them. Never evicted: a layer an image in use names (a live sandbox's, one being
  created, one pinned) or one a local image names (built, imported, a snapshot made here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

from dsec import errors
from dsec.edge.core import EdgeCore, EdgePart
from dsec.layers import distribution
from dsec.layers.store import Image, remove_tree

log = logging.getLogger("dsec.edge")
T = TypeVar("T")


class LayerCache(EdgePart):
    """Pulls, pushes and evicts (see the module)."""

    def __init__(self, core: EdgeCore, *, images_in_use: Callable[[], set[str]]) -> None:
        super().__init__(core)
        self._images_in_use = images_in_use  # live sandboxes' and creates' images
        self._client: distribution.RegistryClient | None = None
        # by "manifest:<name>" / "image:<name>" / "layer:<ref>:<digest>"
        self._pulling: dict[str, asyncio.Future[Any]] = {}
        self._pins: dict[str, int] = {}
        self._used: dict[str, float] = {}  # layer ref -> last use (monotonic), for LRU

    @property
    def client(self) -> distribution.RegistryClient | None:
        url = self.settings.registry
        if url and self._client is None:
            self._client = distribution.RegistryClient(url)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- pulls ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def using(self, name: str, project: str | None = None) -> AsyncIterator[None]:
        """Hold image `name` for a create in `project`: pulled first when missing (and a
        registry is set), never evicted until the block ends."""
        self._pins[name] = self._pins.get(name, 0) + 1
        try:
            await self.ensure_image(name, project)
            yield
        finally:
            self._pins[name] -= 1
            if not self._pins[name]:
                del self._pins[name]

    async def ensure_image(self, name: str, project: str | None = None) -> None:
        """Image `name` in the store, pulled when missing. With `project`, a snapshot of
        another project is image_not_found before any of its layers is pulled (a tenant
        cannot make an edge fetch what it may not use)."""
        if self.layers.has_image(name):
            self._touch(name)
            return
        if self.client is None:
            raise errors.ImageNotFound(
                f"image {name!r} is not on edge {self.name}, and the edge has no registry to pull it "
                f"from: build or import it here, or push it to a registry (dsec image push {name} "
                "--registry URL) and point the edges at it (DSEC_EDGE_REGISTRY=URL)",
                image=name,
                reason="no_registry",
            )
        pulled = await self._once(f"manifest:{name}", lambda: self._read_manifest(name))
        if project is not None and not pulled.image.usable_by(project):
            raise errors.ImageNotFound(f"there is no snapshot {name!r} in project {project!r}")
        await self._once(f"image:{name}", lambda: self._pull_image(name, pulled))
        self._touch(name)

    async def _once(self, key: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run `make` once for every caller that asks for `key` while it runs."""
        fut = self._pulling.get(key)
        if fut is None:
            fut = asyncio.ensure_future(make())
            self._pulling[key] = fut
            fut.add_done_callback(lambda _f: self._pulling.pop(key, None))
        return cast(T, await asyncio.shield(fut))

    async def _read_manifest(self, name: str) -> distribution.Pulled:
        client = self.client
        assert client is not None
        pulled = await client.pull_manifest(name)
        if pulled is None:
            # (snapshots left out: their names are other projects' business)
            local = [i.name for i in self.layers.list_images() if i.source.get("type") != "snapshot"]
            raise errors.ImageNotFound(
                f"image {name!r} is neither on edge {self.name} ({', '.join(local) or 'no images'}) "
                f"nor in registry {client.url}; push it there (dsec image push {name} --registry URL)",
                image=name,
            )
        return pulled

    async def _pull_image(self, name: str, pulled: distribution.Pulled) -> None:
        client = self.client
        assert client is not None
        t0 = time.monotonic()
        if self.layers.has_image(name):  # pulled while the manifest was read
            return
        missing = [e for e in pulled.layers if not self.layers.has_layer(e.ref)]
        # One future per layer (keyed by its ref and tree digest): a layer two images share, or
        # two creates want at once, is downloaded once.
        results = await asyncio.gather(
            *(
                self._once(
                    f"layer:{e.ref}:{e.tree_digest}", partial(distribution.pull_layer, self.layers, client, e)
                )
                for e in missing
            ),
            return_exceptions=True,
        )
        for r in results:  # every layer was waited for; the first failure is the answer
            if isinstance(r, BaseException):
                raise r
        source = {**pulled.image.source, "pulled_from": client.url, "manifest": pulled.digest}
        image = Image(
            name=name,
            layers=pulled.image.layers,
            created_at=pulled.image.created_at,
            source=source,
            config=pulled.image.config,
        )
        if not self.layers.has_image(name):
            self.layers.put_image(image)
        log.info(
            "edge %s pulled image %s from %s: %d of %d layers in %.2f s",
            self.name, name, client.url, len(missing), len(pulled.layers), time.monotonic() - t0,
        )  # fmt: skip
        self._touch(name)
        trash: list[Path] = []
        self.evict(trash=trash)  # on the loop: no create can start using what it removes meanwhile

        def remove() -> None:
            for p in trash:
                remove_tree(p)

        await asyncio.get_running_loop().run_in_executor(None, remove)

    def _touch(self, name: str) -> None:
        with contextlib.suppress(errors.DsecError):
            now = time.monotonic()
            for ref in self.layers.get_image(name).layers:
                self._used[str(ref)] = now

    # --- pushes -----------------------------------------------------------------------

    async def publish(self, name: str) -> str | None:
        """Push image `name` to the registry (None when no registry is set)."""
        if self.client is None:
            return None
        return await distribution.push_image(self.layers, self.client, name)

    async def unpublish(self, name: str, projects: set[str] | None = None) -> bool:
        """Delete snapshot `name`'s manifest from the registry by digest, once the registry's
        copy says it is a snapshot of one of `projects` (None: any). False when there is no
        registry or it lacks the snapshot. Its blobs stay for the registry's garbage collection."""
        client = self.client
        if client is None:
            return False
        pulled = await client.pull_manifest(name)
        if pulled is None:
            return False
        source = pulled.image.source
        if source.get("type") != "snapshot":
            raise errors.InvalidRequest(f"{name} is not a snapshot")
        if projects is not None and source.get("project") not in projects:
            raise errors.ImageNotFound(f"there is no snapshot {name!r} in your projects")
        gone = await client.delete_manifest(pulled.digest)  # the manifest checked, not the tag's now
        if gone:
            log.info("edge %s deleted snapshot %s from %s (%s)", self.name, name, client.url, pulled.digest)
        return gone

    # --- eviction ---------------------------------------------------------------------

    def evict(self, budget_bytes: int | None = None, *, trash: list[Path] | None = None) -> list[str]:
        """Evict pulled layers, least recently used first, until they fit the budget
        (`registry_cache_mb` unless given; 0 or less: unbounded). Returns the refs evicted.
        `trash`: the evicted trees are only moved out, and listed there for the caller to
        remove off the loop."""
        budget = self.settings.registry_cache_mb << 20 if budget_bytes is None else budget_bytes
        if budget <= 0:
            return []
        pulled = {str(x.ref): x for x in self.layers.list_layers() if x.source.get("type") == "registry"}
        total = sum(x.size_bytes for x in pulled.values())
        if total <= budget:
            return []
        images = self.layers.list_images()
        busy = self._images_in_use() | set(self._pins)
        keep: set[str] = set()  # layers named by an image in use or by a local image
        users: dict[str, list[Image]] = {}
        for img in images:
            local = "pulled_from" not in img.source
            for lref in img.layers:
                users.setdefault(str(lref), []).append(img)
                if local or img.name in busy:
                    keep.add(str(lref))
        order = sorted(
            (r for r in pulled if r not in keep),
            key=lambda r: (self._used.get(r, 0.0), pulled[r].created_at),
        )
        evicted: list[str] = []
        for ref in order:
            if total <= budget:
                break
            try:
                for img in users.get(ref, []):
                    if self.layers.has_image(img.name):
                        self.layers.delete_image(img.name)
                self.layers.delete_layer(ref, trash=trash)
            except errors.DsecError as e:
                log.warning("edge %s: evicting layer %s failed: %s", self.name, ref, e)
                continue
            total -= pulled[ref].size_bytes
            self._used.pop(ref, None)
            evicted.append(ref)
        if evicted:
            log.info("edge %s evicted %d pulled layers: %s", self.name, len(evicted), ", ".join(evicted))
        return evicted

    def describe(self) -> dict[str, Any]:
        return {"registry": self.settings.registry, "pulls_in_flight": len(self._pulling)}
