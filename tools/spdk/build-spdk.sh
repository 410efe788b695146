#!/usr/bin/env bash
# Builds SPDK for ctxfs's `spdk` cargo feature and prints the prefix to use as SPDK_DIR.
#
#   SPDK_DIR=$(bash tools/spdk/build-spdk.sh ../shared/vendor/spdk/spdk-*.tar.gz)
#   SPDK_DIR=$SPDK_DIR cargo build --features spdk ...
#
# TARBALL is an SPDK source snapshot without git submodules (the project vendors one). The
# build lands in a cache directory keyed by the tarball's sha256:
#
#   ${CTXFS_SPDK_CACHE:-~/.cache/ctxfs-spdk}/<sha256>/spdk         source and build tree
#   ${CTXFS_SPDK_CACHE:-~/.cache/ctxfs-spdk}/<sha256>/spdk/build   the prefix printed: lib/
#                                       (lib*.a, lib*.so, lib/pkgconfig/spdk_*.pc), include/
#
# A second run with the same tarball only checks the Debian packages and prints the prefix.
# The build tree is used as the prefix, so `make install` (whose python step needs `uv` from
# PyPI) is not run. Progress goes to stderr; stdout carries only the prefix.
#
# Target: Debian 12 (bookworm), run as root (or with sudo), using Debian's DPDK 22.11. No NVMe,
# hugepages or PCI access is needed to build. Environment:
#   CTXFS_SPDK_CACHE  cache root (default ${XDG_CACHE_HOME:-~/.cache}/ctxfs-spdk)
#   JOBS              make parallelism (default: nproc)
#   NICE              niceness of the compile (default 10: the build shares the machine)
#   SPDK_TARGET_ARCH  -march for SPDK's C code (default native; the cache is per machine)
set -euo pipefail

die() { echo "build-spdk.sh: $*" >&2; exit 1; }
say() { echo "build-spdk.sh [$(date +%T)]: $*" >&2; }

[ $# -eq 1 ] || die "usage: build-spdk.sh TARBALL   (e.g. ../shared/vendor/spdk/spdk-*.tar.gz)"
tarball=$1
[ -f "$tarball" ] || die "no such tarball: $tarball"
tarball=$(cd "$(dirname "$tarball")" && pwd)/$(basename "$tarball")

# Debian packages: the compiler and DPDK for SPDK itself; liburing/libaio for the uring and
# AIO bdevs; libclang for bindgen (the Rust bindings are generated when ctxfs builds); the
# python modules SPDK's code generators import.
packages=(
    gcc g++ make pkg-config util-linux
    libdpdk-dev liburing-dev libaio-dev libnuma-dev uuid-dev libssl-dev libjson-c-dev
    libkeyutils-dev libncurses-dev libbsd-dev
    python3 python3-yaml python3-jinja2 python3-tabulate
    libclang-dev
)

install_packages() {
    local missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "missing Debian packages (${missing[*]}) and not root"
        sudo=(sudo)
    fi
    say "installing ${#missing[@]} Debian packages: ${missing[*]}"
    "${sudo[@]}" apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

hash=$(sha256sum "$tarball" | cut -d' ' -f1)
root=${CTXFS_SPDK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ctxfs-spdk}
dir=$root/$hash
src=$dir/spdk
prefix=$src/build
stamp=$dir/built

install_packages

mkdir -p "$root"
# One build per tarball at a time: a second caller waits, then finds the stamp.
exec 9>"$root/$hash.lock"
flock 9

if [ -f "$stamp" ] && [ -f "$prefix/lib/pkgconfig/spdk_event.pc" ]; then
    say "cached: $prefix"
    echo "$prefix"
    exit 0
fi

say "building $(basename "$tarball") (sha256 ${hash:0:12}) in $dir"
rm -rf "$src" "$stamp"
mkdir -p "$src"
# The snapshot has no top-level directory.
tar -xzf "$tarball" -C "$src"
cd "$src"

# --- Local fixes for Debian 12's DPDK 22.11.x -------------------------------------------------
# (1) env_dpdk links a fixed list of DPDK libraries, including rte_log and rte_argparse, which
#     only exist from DPDK 23.11 and 24.03 on. Drop the names DPDK_LIB_DIR does not have.
grep -q '^DPDK_LIB_LIST_SORTED = ' lib/env_dpdk/env.mk || die "lib/env_dpdk/env.mk: layout changed"
sed -i 's|^DPDK_LIB_LIST_SORTED = |# ctxfs: only the DPDK libraries this DPDK has.\nDPDK_LIB_LIST := $(foreach l,$(DPDK_LIB_LIST),$(if $(wildcard $(DPDK_LIB_DIR)/lib$(l).so*),$(l)))\n&|' \
    lib/env_dpdk/env.mk
# (2) At run time env_dpdk refuses DPDK 22.11.x for x > 4 (it uses DPDK's private PCI bus
#     structures, which an LTS point release could change). Debian ships 22.11.11; its private
#     PCI bus headers match SPDK's copies in lib/env_dpdk/22.11/ (checked when the vendored
#     snapshot was taken, see ../shared/vendor/spdk/NOTES.md), so accept up to 22.11.11.
grep -q 'if (minor > 4) {' lib/env_dpdk/pci_dpdk.c || die "lib/env_dpdk/pci_dpdk.c: version check changed"
sed -i 's|if (minor > 4) {|if (minor > 11) { /* ctxfs: 22.11.5-22.11.11 checked */|' lib/env_dpdk/pci_dpdk.c

# --- Configure --------------------------------------------------------------------------------
# System DPDK (pkg-config), shared and static libraries, uring and AIO bdevs, NVMe (PCIe, and
# TCP for NVMe-oF) always built in. No apps, examples or tests: ctxfs links the libraries.
# x86 configure insists on ISA-L; Debian's 2.30 is too old for SPDK (no crc64_rocksoft), so
# configure is pointed at it and ISA-L is then switched off (SPDK has C fallbacks).
say "configure"
PATH=/usr/sbin:/usr/bin:/sbin:/bin ./configure \
    --target-arch="${SPDK_TARGET_ARCH:-native}" \
    --with-dpdk --with-shared --with-uring --with-isal=/usr \
    --without-isal-crypto --without-crypto --without-vhost --without-virtio --without-vfio-user \
    --without-ocf --without-xnvme --without-idxd --without-nvme-cuse --without-fsdev \
    --disable-tests --disable-unit-tests --disable-examples --disable-apps \
    >"$dir/configure.log" 2>&1 || { tail -30 "$dir/configure.log" >&2; die "configure failed (log: $dir/configure.log)"; }
# IPSEC_MB is switched on because `pkg-config --static libdpdk` mentions it; it would make the
# top-level Makefile build the missing intel-ipsec-mb submodule. Crypto is off, so turn it off.
sed -i -e 's/^CONFIG_IPSEC_MB?=y$/CONFIG_IPSEC_MB?=n/' \
    -e 's/^CONFIG_ISAL?=y$/CONFIG_ISAL?=n/' \
    -e 's/^CONFIG_ISAL_INSTALLED?=y$/CONFIG_ISAL_INSTALLED?=n/' \
    -e 's|^CONFIG_ISAL_PATH?=.*$|CONFIG_ISAL_PATH?=|' mk/config.mk

# --- Build ------------------------------------------------------------------------------------
# SPDK's generators run via `#!/usr/bin/env python3` and need Debian's python3-yaml/jinja2: put
# the system python first (a pyenv or venv python may not see them).
jobs=${JOBS:-$(nproc)}
say "make -j$jobs (log: $dir/make.log)"
t0=$SECONDS
PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH nice -n "${NICE:-10}" make -j"$jobs" >"$dir/make.log" 2>&1 ||
    { tail -40 "$dir/make.log" >&2; die "make failed (log: $dir/make.log)"; }
say "built in $((SECONDS - t0)) s"

for pc in spdk_event spdk_event_bdev spdk_bdev spdk_bdev_aio spdk_bdev_uring spdk_bdev_nvme spdk_env_dpdk spdk_syslibs; do
    [ -f "$prefix/lib/pkgconfig/$pc.pc" ] || die "build finished without $prefix/lib/pkgconfig/$pc.pc"
done
# Object files are not needed once the archives exist.
find "$src/lib" "$src/module" -name '*.o' -delete
touch "$stamp"
say "done: SPDK_DIR=$prefix"
echo "$prefix"
