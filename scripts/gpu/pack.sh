#!/usr/bin/env bash
# Build the GPU tests and the kiln binary (profile `gpu`: optimised, no fat LTO) into
# .gpu-bin/, stripped and xz-compressed, for a GPU machine without a Rust toolchain (see
# ../shared/gpu/README.md). A device call carries the tracked tree (~30 MB) and .gpu-bin
# in 64 MiB: this prints both sizes and warns past it.
#   scripts/gpu/pack.sh                      every test binary of the GPU crates
#   scripts/gpu/pack.sh grad train products  only these test binaries (by name; a name
#                                            several crates use, as crate/name: kiln-cuda/ops)
#   KEEP=kiln-before scripts/gpu/pack.sh ... also keeps an earlier .gpu-bin/kiln as
#                                            .gpu-bin/kiln-before (an A/B in one call)
#   NVRTC=/path/libnvrtc.so.13 ...           also the CUDA kernels prebuilt for the GPU
#                                            machine (scripts/gpu/prebuild_kernels.py: use
#                                            its NVRTC, 13.0.88, or the cache only misses;
#                                            a fresh machine then skips ~70 s of NVRTC)
#   GL=1 ...                                 also ../shared/gpu/gl/*.deb (the Vulkan loader
#                                            and GL libraries NVIDIA's ICD needs: kiln-wgpu)
# There, from the repository root, `source .gpu-bin/unpack.sh` decompresses, links the
# checkout where the test binaries look for tests/fixtures (/work/main, their build path),
# installs the GL packages and sets KILN_CACHE_DIR and VK_DRIVER_FILES; then e.g.
#   for t in .gpu-bin/*-*; do $t --include-ignored || exit 1; done
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=.gpu-bin
crates=(-p kiln-cuda -p kiln-wgpu -p kiln-models -p kiln-optim -p kiln-train -p kiln-cpu)
keep=${KEEP:-}
if [ -n "$keep" ]; then
  [ -e "$out/kiln.xz" ] || { echo "KEEP=$keep: no $out/kiln.xz to keep" >&2; exit 1; }
fi
# Build everything before touching $out: a failed build (or one stopped halfway) leaves
# the last pack, and the binary KEEP names, where they were.
exes=$(mktemp)
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
        crate = m["manifest_path"].rsplit("/", 2)[-2]
        if len(sys.argv) == 1 or name in sys.argv[1:] or f"{crate}/{name}" in sys.argv[1:]:
            print(m["executable"])' "$@" > "$exes"
cargo build --profile gpu -p kiln-cli
if [ -n "$keep" ]; then
  cp "$out/kiln.xz" "/tmp/$keep.xz"
  # Its kernel cache too, when it had one.
  # (A copy left by an earlier run would take this one inside it.)
  rm -rf "/tmp/$keep.kc"
  [ -d "$out/kc" ] && cp -r "$out/kc" "/tmp/$keep.kc"
fi
rm -rf "$out"; mkdir -p "$out"
while read -r exe; do cp "$exe" "$out/"; done < "$exes"
rm -f "$exes"
cp target/gpu/kiln "$out/"
strip "$out"/*
xz -T0 -6 "$out"/*
if [ -n "$keep" ]; then
  mv "/tmp/$keep.xz" "$out/$keep.xz"
  if [ -d "/tmp/$keep.kc" ]; then
    mkdir -p "$out/kc"; cp -rn "/tmp/$keep.kc/." "$out/kc/"; rm -rf "/tmp/$keep.kc"
  fi
fi
if [ -n "${NVRTC:-}" ]; then
  kc=$(mktemp -d)
  LD_LIBRARY_PATH="$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    python3 scripts/gpu/prebuild_kernels.py "$kc" --nvrtc "$NVRTC" | grep cubin
  mkdir -p "$out/kc/cuda"
  for f in "$kc"/cuda/*.cubin; do xz -T0 -6 -c "$f" > "$out/kc/cuda/$(basename "$f").xz"; done
  rm -rf "$kc"
fi
if [ "${GL:-0}" = 1 ]; then
  mkdir -p "$out/gl"; cp ../shared/gpu/gl/*.deb "$out/gl/"
fi
cat > "$out/unpack.sh" <<'EOF'
# Sourced on the GPU machine from the repository root (see scripts/gpu/pack.sh).
find .gpu-bin -name '*.xz' -exec xz -d -f {} +
chmod +x .gpu-bin/kiln* .gpu-bin/*-* 2>/dev/null || true
mkdir -p /work && ln -sfn "$PWD" /work/main
[ -d .gpu-bin/kc ] && export KILN_CACHE_DIR=$PWD/.gpu-bin/kc
if [ -d .gpu-bin/gl ]; then
  for d in .gpu-bin/gl/*.deb; do dpkg -x "$d" /; done
  ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
EOF
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
bin_bytes=$(du -sb "$out" | cut -f1)
ls "$out"
echo "$out: $((bin_bytes >> 20)) MiB; with the tracked tree: $(((bin_bytes + tree_bytes) >> 20)) MiB of the 64 a device call carries"
if [ $((bin_bytes + tree_bytes)) -gt $((64 << 20)) ]; then
  echo "too large for a device call: name fewer test binaries" >&2
fi
