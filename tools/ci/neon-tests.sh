#!/usr/bin/env bash
# Runs the kernel tests for aarch64 (the NEON path) under qemu user-mode emulation: this
# project's machines are x86-64, so this is how CI checks the NEON kernels against the
# scalar reference. Installs what it needs (Debian: qemu-user, an aarch64 linker and libc).
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
fi
rustup target add aarch64-unknown-linux-gnu >/dev/null 2>&1

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo test -p ctxfs-kernels --target aarch64-unknown-linux-gnu --target-dir target/aarch64
