#!/usr/bin/env python3
"""Compile kiln's CUDA kernels here, for the GPU machine, into a kernel cache that kiln
finds there (KILN_CACHE_DIR): a fresh device machine then skips the ~70 s NVRTC compile
of every build it runs, which is time out of the session's device budget.

    python3 scripts/gpu/prebuild_kernels.py OUT_DIR [--repo .] [--nvrtc LIB]
        [--arch 90] [--driver 13000]

The entry is the one crates/kiln-cuda/src/compile.rs would write there: the same source
(its SOURCES, in order, each under a `#line` marker), the same NVRTC options, named by the
same FNV-1a key (source, then "sm_XY driver D nvrtc M.m"), in the same framing (magic,
length, checksum). Use the NVRTC the GPU machine has (13.0.88 on the H200 of
../shared/gpu/README.md: `pip download nvidia-cuda-nvrtc==13.0.88 --no-deps`, unzip,
--nvrtc .../nvidia/cu13/lib/libnvrtc.so.13), so the cubin is the one it would compile;
`--driver` is cuDriverGetVersion's value there (13000 for driver 580). A wrong key only
misses (kiln compiles as before); a cubin the driver refuses is dropped and rebuilt.
For an A/B of two builds, run it on each checkout into the same OUT_DIR.
"""
import argparse
import ctypes
import os
import re
import sys

MAGIC = b"KILNCUBN"
FNV_OFFSET = 0xCBF29CE484222325


def fnv1a(data, h=FNV_OFFSET):
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def program_source(repo):
    compile_rs = open(os.path.join(repo, "crates/kiln-cuda/src/compile.rs")).read()
    files = re.findall(r'\(\s*"([\w.]+)",\s*include_str!\("kernels/([\w.]+)"\),?\s*\)', compile_rs)
    if not files:
        sys.exit("no SOURCES found in compile.rs")
    src = ""
    for name, path in files:
        text = open(os.path.join(repo, "crates/kiln-cuda/src/kernels", path)).read()
        src += f'// ---- {name} ----\n#line 1 "{name}"\n{text}\n'
    return src


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--repo", default=".")
    ap.add_argument("--nvrtc", default="libnvrtc.so.13")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--driver", type=int, default=13000)
    a = ap.parse_args()

    nv = ctypes.CDLL(a.nvrtc)
    major, minor = ctypes.c_int(), ctypes.c_int()
    nv.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    src = program_source(a.repo)
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kiln_kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture=sm_{a.arch}".encode(), b"--std=c++17", b"--fmad=true", b"-lineinfo"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    if nv.nvrtcCompileProgram(prog, len(opts), arr):
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode(errors="replace"))
    size = ctypes.c_size_t()
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetCUBIN(prog, cubin)
    cubin = cubin.raw

    key = fnv1a(f"sm_{a.arch} driver {a.driver} nvrtc {major.value}.{minor.value}".encode(),
                fnv1a(src.encode()))
    path = os.path.join(a.out, "cuda", f"kernels-sm{a.arch}-{key:016x}.cubin")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(MAGIC + len(cubin).to_bytes(8, "little") + fnv1a(cubin).to_bytes(8, "little") + cubin)
    os.replace(path + ".tmp", path)
    print(f"{path}: {len(cubin)} bytes, NVRTC {major.value}.{minor.value}, driver {a.driver}")


if __name__ == "__main__":
    main()
