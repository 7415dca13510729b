#!/usr/bin/env bash
# Profile-guided release build of kiln:
#   1. build an instrumented binary,
#   2. run a representative workload with it (`kiln bench`, `kiln info`),
#   3. merge the profiles with llvm-profdata,
#   4. rebuild using them.
# The result is target/pgo/kiln. Extra RUSTFLAGS (e.g. -C target-cpu=native) are kept.
#
# llvm-profdata must come from the same LLVM major version as rustc. The script looks for
# $LLVM_PROFDATA, then rustup's llvm-tools component (`rustup component add llvm-tools`),
# then llvm-profdata on PATH. If none is found, or the one found cannot read rustc's
# profiles, it says so and builds the plain release profile instead.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

plain_build() {
    echo "pgo-build: $1" >&2
    echo "pgo-build: falling back to the plain release build (target/release/kiln)." >&2
    cargo build --release -p kiln-cli
    exit 0
}

host=$(rustc -vV | sed -n 's/^host: //p')
rustc_llvm=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
candidates=("${LLVM_PROFDATA:-}" "$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
            "$(command -v "llvm-profdata-$rustc_llvm" || true)" "$(command -v llvm-profdata || true)")
profdata=""
for c in "${candidates[@]}"; do
    [ -n "$c" ] && [ -x "$c" ] && { profdata=$c; break; }
done
[ -n "$profdata" ] || plain_build "llvm-profdata not found (install it: rustup component add llvm-tools)."
echo "pgo-build: using $profdata (rustc uses LLVM $rustc_llvm)" >&2

data="$PWD/pgo-data"
rm -rf "$data" && mkdir -p "$data"
base_flags=${RUSTFLAGS:-}

echo "pgo-build: 1/4 instrumented build" >&2
RUSTFLAGS="$base_flags -Cprofile-generate=$data" \
    cargo build --profile pgo -p kiln-cli --target-dir target/pgo-instrumented
bin=target/pgo-instrumented/pgo/kiln

echo "pgo-build: 2/4 representative run" >&2
LLVM_PROFILE_FILE="$data/kiln-%p-%m.profraw" "$bin" bench --kernels -r 3 >/dev/null
LLVM_PROFILE_FILE="$data/kiln-%p-%m.profraw" "$bin" info tests/data/tiny-llama.gguf >/dev/null

echo "pgo-build: 3/4 merge" >&2
if ! "$profdata" merge -o "$data/merged.profdata" "$data"/*.profraw 2>"$data/merge.log"; then
    plain_build "$profdata cannot read rustc's profiles (LLVM version mismatch?): $(head -c 300 "$data/merge.log")"
fi

echo "pgo-build: 4/4 optimised build" >&2
RUSTFLAGS="$base_flags -Cprofile-use=$data/merged.profdata" cargo build --profile pgo -p kiln-cli
echo "pgo-build: built target/pgo/kiln" >&2
