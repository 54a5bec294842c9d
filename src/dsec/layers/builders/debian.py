"""Debian recipes (layers/recipes/*.toml) built with mmdebstrap into layers."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from dsec import errors
from dsec.layers.builders.common import Progress, _say
from dsec.layers.builders.tree import _is_whiteout_dev
from dsec.layers.store import Image, Layer, LayerStore, _make_ref

# --------------------------------------------------------------------------- recipes


_VARIANTS = frozenset(
    {
        "extract",
        "custom",
        "essential",
        "apt",
        "required",
        "minbase",
        "buildd",
        "important",
        "debootstrap",
        "standard",
    }
)
_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]*(:[a-z0-9-]+)?(=[A-Za-z0-9.+~:-]+)?$")
_SUITE_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,63}$")


class DebianRecipe(BaseModel):
    """A Debian root filesystem built by mmdebstrap."""

    model_config = ConfigDict(extra="forbid")

    name: str
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: list[str]
    mirror: str = "http://deb.debian.org/debian"

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        _make_ref(v, "1")
        return v

    @field_validator("suite")
    @classmethod
    def _valid_suite(cls, v: str) -> str:
        if not _SUITE_RE.match(v):
            raise ValueError(f"suite {v!r} is invalid: use a Debian suite or codename such as 'bookworm'")
        return v

    @field_validator("variant")
    @classmethod
    def _valid_variant(cls, v: str) -> str:
        if v not in _VARIANTS:
            raise ValueError(f"variant {v!r} is invalid: use one of {', '.join(sorted(_VARIANTS))}")
        return v

    @field_validator("packages")
    @classmethod
    def _valid_packages(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not _PKG_RE.match(p)]
        if bad:
            raise ValueError(f"package names {bad} are invalid: use Debian package names such as 'python3'")
        return v

    @field_validator("mirror")
    @classmethod
    def _valid_mirror(cls, v: str) -> str:
        if not re.match(r"^(https?|file)://[^\s,]+$", v):
            raise ValueError(f"mirror {v!r} is invalid: use an http://, https:// or file:// URL")
        return v

    def digest(self) -> str:
        """sha256 (hex) of the recipe's canonical JSON; the build-cache key.

        Package order and duplicates do not matter (mmdebstrap installs a set)."""
        canon = {
            "name": self.name,
            "suite": self.suite,
            "variant": self.variant,
            "packages": sorted(set(self.packages)),
            "mirror": self.mirror,
        }
        return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _recipes_dir() -> Any:
    return resources.files("dsec.layers").joinpath("recipes")


def list_recipes() -> list[str]:
    """Names of the recipes shipped with dsec (``src/dsec/layers/recipes/<name>.toml``)."""
    return sorted(p.name[: -len(".toml")] for p in _recipes_dir().iterdir() if p.name.endswith(".toml"))


def load_recipe(name: str) -> DebianRecipe:
    """The shipped recipe ``name``; :class:`errors.ImageNotFound` listing the known ones otherwise."""
    known = list_recipes()
    if name not in known:
        raise errors.ImageNotFound(
            f"there is no recipe for image {name!r}; known recipes: {', '.join(known) or 'none'}",
            image=name,
            available=known,
        )
    data = tomllib.loads(_recipes_dir().joinpath(f"{name}.toml").read_text(encoding="utf-8"))
    data.setdefault("name", name)
    try:
        return DebianRecipe.model_validate(data)
    except ValidationError as e:
        raise errors.InternalError(f"the shipped recipe {name!r} is invalid: {e}") from None


# --------------------------------------------------------------------------- mmdebstrap


def _run_logged(cmd: list[str], what: str, progress: Progress | None) -> None:
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as e:
        raise errors.InternalError(f"could not run {cmd[0]} for {what}: {e}") from None
    with proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            _say(progress, line)
        rc = proc.wait()
    if rc != 0:
        raise errors.InternalError(
            f"{os.path.basename(cmd[0])} failed (exit {rc}) for {what}; last output:\n" + "\n".join(tail),
            exit_code=rc,
        )


def _inside(tree: Path, p: Path) -> bool:
    try:
        return p.resolve().is_relative_to(tree.resolve())
    except OSError:
        return False


def _empty_dir(d: Path, keep: frozenset[str] = frozenset()) -> None:
    """Remove what ``d`` holds (not following symlinks), except the names in ``keep``."""
    for p in d.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _trim_debian_tree(tree: Path) -> None:
    """Drop apt's caches and package lists and /dev's device nodes; make sure /work exists."""
    cache = tree / "var/cache/apt"
    if cache.is_dir() and _inside(tree, cache):
        for p in cache.glob("*.bin"):
            if not p.is_symlink() and p.is_file():
                p.unlink()
    lists = tree / "var/lib/apt/lists"
    if lists.is_dir() and _inside(tree, lists):
        _empty_dir(lists, keep=frozenset({"partial", "lock"}))
        partial = lists / "partial"
        if partial.is_dir() and not partial.is_symlink():
            _empty_dir(partial)
    dev = tree / "dev"
    if dev.is_dir() and not dev.is_symlink():
        # mmdebstrap leaves device nodes in /dev; the runtime provides /dev, and layers carry no
        # device nodes other than overlay whiteouts
        for p in dev.iterdir():
            st = os.lstat(p)
            is_dev = stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            if is_dev and not _is_whiteout_dev(st.st_mode, st.st_rdev):
                p.unlink()
    work = tree / "work"
    if not os.path.lexists(work):
        work.mkdir()
        os.chown(work, 0, 0)
    if work.is_dir() and not work.is_symlink():
        os.chmod(work, 0o755)


def build_debian_layer(
    store: LayerStore,
    recipe: DebianRecipe,
    *,
    version: str | None = None,
    progress: Progress | None = None,
) -> Layer:
    """Build (or fetch from the build cache) the layer for ``recipe`` with mmdebstrap.

    ``version`` defaults to the first 12 hex digits of the recipe digest. A cache hit (or an
    existing layer of that name and version built from the same recipe) returns without
    running mmdebstrap."""
    key = recipe.digest()
    if version is None:
        cached = store.cache_get(key)
        if cached is not None:
            _say(progress, f"build cache hit: {cached}")
            return store.get_layer(cached)
        version = key[:12]
    ref = _make_ref(recipe.name, version)
    if store.has_layer(ref):
        existing = store.get_layer(ref)
        if existing.source.get("recipe_digest") != key:
            raise errors.Conflict(
                f"layer {ref} exists but was not built from this recipe (digest {key[:12]}); "
                "pick another version",
                layer=str(ref),
            )
        store.cache_put(key, ref)
        return existing
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise errors.InternalError("mmdebstrap is not installed on this host: apt-get install mmdebstrap")
    source = {"type": "debian", "recipe": recipe.model_dump(), "recipe_digest": key}
    with store.staging() as staging:
        tree = staging / "rootfs"
        cmd = [exe, "--mode=root", f"--variant={recipe.variant}", "--format=directory"]
        if recipe.packages:
            cmd.append("--include=" + ",".join(recipe.packages))
        cmd += [recipe.suite, str(tree), recipe.mirror]
        _say(progress, f"building {ref}: {' '.join(cmd)}")
        _run_logged(cmd, f"layer {ref}", progress)
        _trim_debian_tree(tree)
        _say(progress, f"committing {ref}")
        layer = store.commit_layer(tree, recipe.name, version, source, shift=True)
    store.cache_put(key, layer.ref)
    _say(progress, f"built {layer.ref} ({layer.digest}, {layer.size_bytes} bytes, {layer.files} files)")
    return layer


def build_recipe_image(store: LayerStore, name: str, *, progress: Progress | None = None) -> Image:
    """Build the shipped recipe ``name`` and store a one-layer image of the same name."""
    recipe = load_recipe(name)
    layer = build_debian_layer(store, recipe, progress=progress)
    image = Image(
        name=name,
        layers=[layer.ref],
        source={"type": "recipe", "recipe": name, "recipe_digest": recipe.digest()},
    )
    store.put_image(image)
    return image
