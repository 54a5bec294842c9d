#!/usr/bin/env bash
# dsec setup for a Debian 12 machine, as root. Idempotent; a second run takes seconds.
#
#   ./install.sh up [dsec up options]   install everything, build the default image, run `dsec up`
#   ./install.sh test [pytest options]  install everything (+ test tools), then lint, type-check and test
#   ./install.sh bench NAME [options]   install everything (+ podman, the baseline), run bench/NAME.py
#   ./install.sh                        install only
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
ROOT=$(pwd)
VENV="$ROOT/.venv"

APT_PACKAGES=(crun runc mmdebstrap bubblewrap gcc libc6-dev iproute2 nftables procps ca-certificates
              btrfs-progs xfsprogs tar gzip zstd python3-venv debian-archive-keyring
              bash-static  # bash-static: the trusted shell of bash sessions (/.dsec-tools/bash)
              qemu-system-x86 erofs-utils e2fsprogs  # the microVM tier: QEMU microvm, EROFS layers, ext4 disks
              postgresql  # the cluster's IAM (dsec apiserver --database; dsec cluster up starts its own)
              docker-registry  # the OCI distribution server layers travel through (DSEC_EDGE_REGISTRY)
              skopeo  # image pulls by reference from OCI registries (dsec image pull, layers/pull.py)
              buildah)  # Dockerfile builds (dsec image build -f: layers/dockerbuild.py); test images

log() { printf '\033[1m[dsec-install]\033[0m %s\n' "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh must run as root: dsec manages namespaces, cgroups and mounts" >&2
  exit 1
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.dsec-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "pip: installing dsec and its dependencies into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
ln -sf "$VENV/bin/dsec" /usr/local/bin/dsec

# Memory checkpoints need CRIU >= 4.2 (Debian 12's 3.17 fails on current kernels): unpacked from
# Debian's next release into /var/lib/dsec/criu with a private apt state (the host's is untouched).
if ! "$VENV/bin/python" -c 'from pathlib import Path; from dsec.backends.criu import ensure_criu; ensure_criu(Path("/var/lib/dsec"))'; then
  log "warning: CRIU >= 4.2 could not be fetched: memory checkpoints stay unavailable (everything else works)"
fi

# backend="gvisor" needs runsc >= 20240729 (Debian 12's fails on current kernels; forky's Go 1.26 build
# crashes): trixie's, unpacked into /var/lib/dsec/runsc the same way, smoke-tested before it is kept.
if ! "$VENV/bin/python" -c 'from pathlib import Path; from dsec.backends.runsc import ensure_runsc; ensure_runsc(Path("/var/lib/dsec"))'; then
  log "warning: runsc could not be fetched: the gvisor backend is reported absent (everything else works)"
fi

# backend="microvm" boots Debian's cloud kernel (virtio, EROFS, overlayfs as modules) under QEMU:
# unpacked into /var/lib/dsec/microvm/kernel the same way (nothing installed into /boot).
if ! "$VENV/bin/python" -c 'from pathlib import Path; from dsec.backends.qemu import ensure_guest_kernel; ensure_guest_kernel(Path("/var/lib/dsec"))'; then
  log "warning: the guest kernel could not be fetched: microVMs stay unavailable (everything else works)"
fi

log "images: python (default, ~30 s) and code (fncall / SandboxFusion, every language, ~2 min); cached after the first build"
"$VENV/bin/dsec" image build python --quiet
"$VENV/bin/dsec" image build code --quiet

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  up)
    exec "$VENV/bin/dsec" up "$@" ;;
  test)
    "$VENV/bin/ruff" check src tests bench
    "$VENV/bin/mypy"
    "$VENV/bin/lint-imports" --no-cache
    exec "$VENV/bin/pytest" "$@" ;;
  bench)
    # The benchmarks measure against `podman run --rm` of the same rootfs in the same run.
    if ! dpkg-query -W -f='${Status}' podman 2>/dev/null | grep -q "install ok installed"; then
      log "apt: installing podman (the benchmarks' baseline)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman >/dev/null
    fi
    name=${1:?usage: ./install.sh bench NAME [options]  (NAME: a file in bench/, without .py)}
    shift
    exec "$VENV/bin/python" "bench/$name.py" "$@" ;;
  "")
    log "installed: run 'dsec up' to start the service" ;;
  *)
    echo "usage: ./install.sh [up|test|bench] [args...]" >&2; exit 2 ;;
esac
