#!/usr/bin/env python3
"""Compiles sim/gpu/attention.cu to PTX with NVRTC (the nvidia-cuda-nvrtc-cu12
wheel: no CUDA toolkit, no GPU), through ctypes.

    build_ptx.py [--check]     write sim/gpu/attention.ptx, or with --check
                               compare it with the committed file (exit 1 if
                               they differ; exit 3 if NVRTC cannot be found).

The PTX targets compute_90 (H100/H200): the driver JIT-compiles it for the
GPU it runs on (cuModuleLoadData).
"""
import ctypes
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "attention.cu")
PTX = os.path.join(HERE, "attention.ptx")
OPTIONS = [b"--gpu-architecture=compute_90", b"--std=c++17", b"-default-device", b"--use_fast_math"]


def find_nvrtc():
    try:
        import nvidia.cuda_nvrtc  # noqa: F401  (the wheel's package)

        roots = list(nvidia.cuda_nvrtc.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*"))):
            if "builtins" not in path and ".alt." not in path:
                return path
    return None


def compile_ptx(lib_path):
    nvrtc = ctypes.CDLL(lib_path)
    src = open(SRC, "rb").read()
    prog = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"attention.cu", 0, None, None))
    opts = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    rc = nvrtc.nvrtcCompileProgram(prog, len(OPTIONS), opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit("NVRTC failed:\n" + log.value.decode(errors="replace"))
    check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx))
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def check(nvrtc, rc):
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit("NVRTC: " + nvrtc.nvrtcGetErrorString(rc).decode())


def main():
    lib = find_nvrtc()
    if lib is None:
        print("build_ptx: NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)", file=sys.stderr)
        sys.exit(3)
    ptx = compile_ptx(lib)
    if "--check" in sys.argv[1:]:
        if open(PTX).read() != ptx:
            sys.exit("build_ptx: sim/gpu/attention.ptx is stale: run sim/gpu/build_ptx.py")
        print("build_ptx: sim/gpu/attention.ptx matches attention.cu")
        return
    with open(PTX, "w") as f:
        f.write(ptx)
    print(f"build_ptx: wrote {PTX} ({len(ptx)} bytes)")


if __name__ == "__main__":
    main()
