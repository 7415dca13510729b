#!/usr/bin/env bash
# llama.cpp's Vulkan backend, the peer of kiln-wgpu (issue 16), built on the development
# machine (Debian 12) and packed for the GPU machine, which has neither a shader compiler
# nor Vulkan headers. Debian's own are too old: its Vulkan-Hpp (1.3.239) lacks what
# ggml-vulkan.cpp uses, and its glslc (2023.2) has no cooperative matrices or integer dot
# products, without which llama.cpp's Vulkan backend would not be its fast self. So:
#   1. glslc from google/shaderc with the glslang, SPIRV-Tools and SPIRV-Headers commits
#      its DEPS file pins;
#   2. Vulkan-Hpp's headers generated from Vulkan-Headers' registry/vk.xml by Vulkan-Hpp's
#      own generator (the stored Vulkan-Headers snapshot lacks the large generated .hpp
#      files), beside Vulkan-Headers' C headers;
#   3. llama.cpp, unmodified, with both; llama-bench and its libraries packed with xz.
# Sources are git mirrors (the tool library's `fetch` puts them under /work/.mirror):
#   scripts/gpu/build-llama-vulkan.sh WORK_DIR
# Then on the GPU machine: unpack the tarball, install the Vulkan loader from
# ../shared/gpu/gl/*.deb (as scripts/gpu/wgpu-ab.sh does) and run
# `LD_LIBRARY_PATH=. ./llama-bench -m MODEL.gguf -p 512 -n 128 -ngl 99`.
# About 20 minutes on 2 cores. Nothing it fetches or builds belongs in the repository.
set -euo pipefail
work=${1:?usage: build-llama-vulkan.sh WORK_DIR}
mirror=${MIRROR:-/work/.mirror}
mkdir -p "$work"
cd "$work"
jobs=${JOBS:-2}

apt-get install -y glslc libvulkan-dev spirv-headers cmake g++ >/dev/null

# A checkout of `rev` (default: the mirror's HEAD) of mirror `name` into `dir`, skipping
# files whose objects the snapshot does not hold.
checkout() {
  local name=$1 dir=$2 rev=${3:-HEAD}
  rm -rf "$dir"
  git clone -q --no-checkout "$mirror/$name/repo" "$dir"
  git -C "$dir" read-tree "$rev"
  git -C "$dir" ls-files | while read -r f; do
    if git -C "$dir" cat-file -e ":$f" 2>/dev/null; then echo "$f"; fi
  done | git -C "$dir" checkout-index --stdin -f
}

# 1. glslc.
checkout google+shaderc shaderc
pin() { sed -n "s/.*'$1': '\([0-9a-f]*\)'.*/\1/p" shaderc/DEPS; }
checkout KhronosGroup+glslang shaderc/third_party/glslang "$(pin glslang_revision)"
checkout KhronosGroup+SPIRV-Tools shaderc/third_party/spirv-tools "$(pin spirv_tools_revision)"
checkout KhronosGroup+SPIRV-Headers shaderc/third_party/spirv-headers "$(pin spirv_headers_revision)"
cmake -S shaderc -B shaderc/build -DCMAKE_BUILD_TYPE=Release -DSHADERC_SKIP_TESTS=ON \
  -DSHADERC_SKIP_EXAMPLES=ON -DSHADERC_SKIP_COPYRIGHT_CHECK=ON -DSPIRV_SKIP_TESTS=ON \
  -DSPIRV_SKIP_EXECUTABLES=ON -DENABLE_GLSLANG_BINARIES=OFF \
  -DSHADERC_ENABLE_WERROR_COMPILE=OFF >/dev/null
cmake --build shaderc/build --target glslc_exe -j"$jobs" >/dev/null
glslc=$PWD/shaderc/build/glslc/glslc
"$glslc" --version | head -1

# 2. Vulkan headers: C headers and vk.xml from Vulkan-Headers, the C++ ones generated.
checkout KhronosGroup+Vulkan-Headers vulkan-headers
checkout KhronosGroup+Vulkan-Hpp vulkan-hpp
checkout leethomason+tinyxml2 vulkan-hpp/tinyxml2
(
  cd vulkan-hpp
  g++ -std=c++20 -O1 -o generate generator/VulkanHppGenerator.cpp generator/VkXMLParser.cpp \
    generator/DependencyParser.cpp tinyxml2/tinyxml2.cpp -Itinyxml2 \
    -DBASE_PATH="\"$PWD\"" -DVK_SPEC="\"$work/vulkan-headers/registry/vk.xml\""
  mkdir -p vulkan
  ./generate -f "$work/vulkan-headers/registry/vk.xml" >/dev/null
)
cp vulkan-hpp/vulkan/*.hpp vulkan-headers/include/vulkan/

# 3. llama.cpp.
checkout unslothai+llama.cpp llama.cpp
rev=$(git -C "$mirror/unslothai+llama.cpp/repo" rev-parse --short HEAD)
cmake -S llama.cpp -B llama.cpp/build -DGGML_VULKAN=ON -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DCMAKE_BUILD_TYPE=Release -DVulkan_GLSLC_EXECUTABLE="$glslc" \
  -DVulkan_INCLUDE_DIR="$work/vulkan-headers/include" | grep -i "glslc" || true
cmake --build llama.cpp/build --target llama-bench -j"$jobs" >/dev/null
(cd llama.cpp/build/bin && tar cf - llama-bench lib*.so*) | xz -T"$jobs" -6 >"llama-vk-$rev.tar.xz"
ls -la "$work/llama-vk-$rev.tar.xz"
