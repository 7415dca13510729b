#!/usr/bin/env bash
# Build the GPU tests and the kiln binary (profile `gpu`: optimised, no fat LTO) into
# .gpu-bin/, stripped, for a GPU machine without a Rust toolchain (see
# ../shared/gpu/README.md), gzipped: stripped, they pass the 64 MiB a device call carries.
# `pack.sh collective tp train` keeps only those test binaries (scripts/gpu/verify_multi.sh
# needs these three).
# Run there from the repository root:
#   gunzip .gpu-bin/*.gz; chmod +x .gpu-bin/*
#   for t in .gpu-bin/*-*; do $t --include-ignored || exit 1; done
# Test binaries find tests/fixtures through the path they were built at (CARGO_MANIFEST_DIR):
# link the checkout there first (`mkdir -p /work && ln -sfn $PWD /work/main`).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=.gpu-bin
crates=(-p kiln-cuda -p kiln-wgpu -p kiln-models -p kiln-optim -p kiln-train -p kiln-cpu)
rm -rf "$out"; mkdir -p "$out"
cargo test --profile gpu --no-run --message-format=json "${crates[@]}" \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        name = m["executable"].rsplit("/", 1)[-1].rsplit("-", 1)[0]
        if len(sys.argv) == 1 or name in sys.argv[1:]:
            print(m["executable"])' "$@" \
  | while read -r exe; do cp "$exe" "$out/"; done
cargo build --profile gpu -p kiln-cli
cp target/gpu/kiln "$out/"
strip "$out"/*
gzip "$out"/*
du -sh "$out"; ls "$out"
