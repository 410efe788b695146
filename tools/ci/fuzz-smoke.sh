#!/usr/bin/env bash
# A short smoke run of every cargo-fuzz target (fuzz/README.md): builds them on stable Rust
# without a sanitizer (`-s none`), runs each for FUZZ_SECONDS (default 20) from its seeds
# (fuzz/seeds/TARGET, with fuzz/seeds/TARGET.dict when there is one), and fails if any target
# crashes, hangs on an input (-timeout) or passes the memory bounds fuzz/README.md documents.
# Prints each target's executions. Crashes are saved under fuzz/artifacts/TARGET/.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"

seconds=${FUZZ_SECONDS:-20}
# A fixed seed makes CI's run the same walk through each target's inputs every time (as far
# as its time allows: a faster machine goes further), so a submission's CI does not fail on a
# crash that chance found elsewhere; longer runs with other seeds (FUZZ_SEED) explore.
seed=${FUZZ_SEED:-1}
# The documented bounds: one allocation at most 64 MiB (also enforced by the targets' own
# allocator, since libFuzzer sees no allocation without a sanitizer), 1 GiB resident.
bounds=(-rss_limit_mb=1024 -malloc_limit_mb=64 -timeout=10)

command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
cargo fuzz build -s none
# Run the built binaries directly: one build, nothing rebuilt between targets.
bin=target/$(rustc -vV | sed -n 's/^host: //p')/release

summary=()
failed=0
for target in $(cargo fuzz list); do
    corpus=$(mktemp -d)
    inputs=("$corpus")
    [ -d "seeds/$target" ] && inputs+=("seeds/$target")
    dict=()
    [ -f "seeds/$target.dict" ] && dict=("-dict=seeds/$target.dict")
    log=$(mktemp)
    echo "== fuzz $target for ${seconds}s"
    mkdir -p "artifacts/$target"
    if "$bin/$target" -artifact_prefix="artifacts/$target/" "${bounds[@]}" "${dict[@]}" \
        -seed="$seed" -max_total_time="$seconds" -print_final_stats=1 "${inputs[@]}" >"$log" 2>&1; then
        runs=$(grep -oE '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 | grep -oE '[0-9]+' || echo "?")
        summary+=("$target: $runs executions, no crash")
    else
        failed=1
        tail -60 "$log"
        summary+=("$target: FAILED (see fuzz/artifacts/$target/)")
    fi
    rm -rf "$corpus" "$log"
done
printf '%s\n' "${summary[@]}"
exit "$failed"
