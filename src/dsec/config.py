"""Settings of each process: one object per process, every host path a field."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from dsec.layers.pull import PullPolicy


def _default_cpu_capacity() -> float:
    # CPU limits are ceilings and CPU is compressible; about 90% of sandboxes use
    # <5% of what they ask. Admission by CPU is a coarse guard only.
    return float((os.cpu_count() or 1) * 1024)


def _default_memory_capacity_mb() -> int:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        pages = 8 << 30
    # Limits are ceilings, not reservations, and idle sandboxes hold a few MiB:
    # admit limits up to 32x the RAM (the memory cgroup still bounds each one).
    return int(pages // (1024 * 1024)) * 32


class EdgeSettings(BaseSettings):
    """The node agent. Environment: DSEC_EDGE_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="DSEC_EDGE_")

    name: str = "n0"
    data_dir: Path = Path("/var/lib/dsec")
    run_dir: Path = Path("/run/dsec")
    layers_dir: Path | None = None
    runtime: str = "crun"
    # The backends this edge runs sandboxes on (dsec.backends.registry), started at edge start.
    backends: list[str] = ["container", "gvisor", "microvm"]  # one that cannot run here is reported absent
    criu_dir: Path = Path("/var/lib/dsec/criu")  # host-wide, unpacked by install.sh
    runsc_dir: Path = Path("/var/lib/dsec/runsc")  # gVisor, host-wide, unpacked by install.sh
    # microVMs: the guest kernel (install.sh), layer disk images, blank disks, template VMs; host-wide
    microvm_dir: Path = Path("/var/lib/dsec/microvm")
    # The layer store's canonical id range (container id N is stored as host id uid_offset + N);
    # each sandbox runs as a range of its own above it (isolation/idranges.py), allocated
    # host-wide through id_registry, shared by every edge of the host.
    uid_offset: int = 100000
    id_registry: Path = Path("/run/dsec-ids")
    max_sandboxes: int = 4000
    capacity_cpu: float = _default_cpu_capacity()
    capacity_memory_mb: int = _default_memory_capacity_mb()
    reconcile_interval_s: float = 60.0
    reaper_interval_s: float = 1.0
    default_image: str = "python"
    # Host tuning: remount cgroup2 with favordynmods (see CgroupHost.favor_dynamic_changes).
    cgroup_favordynmods: bool = True
    # fncall backend: worker sandboxes started at edge start when this image exists.
    fncall_image: str = "code"
    fncall_workers: int = 4
    # Image pulls (layers/pull.py): registries (host:port) this edge may pull from although they
    # are on a loopback/private address or speak plain HTTP (the cluster's own, a LAN mirror);
    # the largest image (compressed layers) and the longest pull.
    pull_local_registries: list[str] = []
    # Dockerfile builds (layers/dockerbuild.py): their storage, per edge (`<builds_dir>/<name>`).
    # Not under data_dir: buildah runs as an unprivileged id range, which must reach it, and the
    # data dir is root's alone (0700).
    builds_dir: Path = Path("/var/lib/dsec-builds")
    pull_max_bytes: int = 32 << 30
    pull_timeout_s: float = 1800.0
    # The platform's addresses on other hosts (apiservers, other edges, databases): IPs, CIDRs,
    # host names or URLs that no sandbox's network policy may ever reach. `dsec edge` adds its
    # own public URL and its apiservers' URLs.
    platform_addresses: list[str] = []
    # An OCI registry images travel through (dsec.layers.distribution): http(s)://host:port[/repo]
    # (repository `dsec` without a path). With one, an image this edge lacks is pulled from it
    # at its first create or pool pre-warm, snapshots are pushed to it when made, and their
    # manifests deleted from it with them. The only way images move between edges: None (one
    # edge, `dsec up`) means this edge uses only the images in its own layer store.
    registry: str | None = None
    # Disk budget of the layers pulled from the registry (MiB of file content; 0: unbounded).
    # Past it the least recently used ones no live sandbox and no local image uses are evicted.
    registry_cache_mb: int = 0
    # An operation (exec, file write or edit, logged event) is answered only once its trajectory
    # entry is committed, so a SIGKILL of the edge loses nothing it acknowledged (concurrent
    # operations share commits). False: answered once queued; a SIGKILL then loses at most a
    # batch or two of acknowledged entries, declared as a gap (dsec.trajlog.log).
    trajectory_durable_acks: bool = True
    # Captured exec output this edge holds at once (MiB; its bytes and the JSON they become),
    # in all and per project. A call past either waits (its pipes are not read: the command
    # blocks writing), except the edge's oldest, so one always finishes (dsec.edge.outputs).
    output_budget_mb: int = Field(1024, ge=1)
    project_output_budget_mb: int = Field(256, ge=1)
    # Exec streams open at once per project on this edge; one more is 429 quota_exceeded.
    project_streams: int = Field(32, ge=1)

    @field_validator("name")
    @classmethod
    def _short_name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]{1,12}", v):
            raise ValueError("edge name must be 1-12 lowercase letters or digits (it is part of sandbox ids)")
        return v

    @property
    def criu_root(self) -> Path:
        """Where install.sh unpacks CRIU (memory checkpoints): shared by every edge of a host."""
        return self.criu_dir

    @property
    def layer_root(self) -> Path:
        return self.layers_dir or self.data_dir / "layers"

    def pull_policy(self) -> PullPolicy:
        from dsec.layers.pull import PullPolicy

        return PullPolicy(frozenset(self.pull_local_registries), self.pull_max_bytes, self.pull_timeout_s)

    @property
    def native_bin_dir(self) -> Path:
        """Where the native helpers are built (named by their source's digest, so shared by
        every edge of a host that shares its layer store: built once, not once per edge)."""
        return self.layer_root.parent / "bin"

    @property
    def disk_dir(self) -> Path:
        """Where sandboxes' writable layers on disk live (unnamed files: see
        dsec.backends.writable) with their blank templates; beside the layer store."""
        return self.layer_root.parent / "disks"

    @property
    def edge_run_dir(self) -> Path:
        return self.run_dir / self.name

    @property
    def db_path(self) -> Path:
        return self.data_dir / f"edge-{self.name}.db"
