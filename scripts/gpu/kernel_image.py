#!/usr/bin/env python3
"""Build a kernel image for `HARRIER_KERNEL_IMAGE` here, without a GPU (measurement only).

    scripts/gpu/kernel_image.py OUT.cubin [-DNAME[=VALUE] ...]

Compiles kernels/cuda/harrier.cu with NVRTC to PTX with the options the engine uses for bf16
(`--gpu-architecture=sm_90 --std=c++17 --fmad=true`, `kernels/src/lib.rs` compile_ptx_with) plus
the given defines, writes OUT.ptx beside OUT, then runs `ptxas -arch=sm_90` to OUT (skipped, the
PTX kept, when OUT ends in .ptx). A device call then loads it with
`HARRIER_KERNEL_IMAGE=OUT harrier-cuda-tool ...` instead of a minute of NVRTC a variant
(docs/cuda.md, Tools). Session 26 found such a cubin (NVRTC and ptxas 12.9) as fast as the
device's own compile of the same source.

NVRTC: libnvrtc.so.12 from $HARRIER_CUDA_DIR/lib (default ~/.cache/harrier/cuda/lib: the
nvidia-cuda-nvrtc-cu12 wheel's lib folder, as for the kernels crate's tests). ptxas: $PTXAS, else
`ptxas` on PATH, else $HARRIER_HOME/ptxas/ptxas (`scripts/setup.sh ptxas` installs it from the
nvidia-cuda-nvcc-cu12 wheel). Before timing a variant against the
default, compare their PTX function by function: a no-op refactor must not change it.
"""
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "kernels" / "cuda" / "harrier.cu"


def nvrtc_ptx(source: bytes, defines: list[str], arch: str = "sm_90") -> bytes:
    cuda = pathlib.Path(os.environ.get("HARRIER_CUDA_DIR", pathlib.Path.home() / ".cache/harrier/cuda"))
    lib = ctypes.CDLL(str(cuda / "lib" / "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"harrier.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--fmad=true"] + [d.encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC failed:\n{log.value.decode(errors='replace')[-6000:]}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def build_image(source: bytes, out: pathlib.Path, defines: list[str], arch: str = "sm_90") -> None:
    """`source` compiled to OUT's PTX beside it, then (unless OUT ends in .ptx) ptxas to OUT.
    (scripts/gpu/f8_probe.py builds its own source for sm_90a with it.)"""
    ptx_path = out if out.suffix == ".ptx" else out.with_suffix(".ptx")
    ptx_path.write_bytes(nvrtc_ptx(source, defines, arch))
    if out.suffix == ".ptx":
        return
    subprocess.run([setup_tool("ptxas"), f"-arch={arch}", "-o", str(out), str(ptx_path)], check=True)


def setup_tool(name: str) -> str:
    """A CUDA tool `name` (ptxas, nvdisasm): $NAME, else on PATH, else where
    `scripts/setup.sh NAME` installs it ($HARRIER_HOME/NAME/NAME)."""
    home = pathlib.Path(os.environ.get("HARRIER_HOME", pathlib.Path.home() / ".cache/harrier"))
    installed = home / name / name
    found = os.environ.get(name.upper()) or shutil.which(name) or (str(installed) if installed.exists() else None)
    if not found:
        sys.exit(f"no {name}: run scripts/setup.sh {name}, or set {name.upper()}")
    return found


def main() -> None:
    if len(sys.argv) < 2 or not all(a.startswith("-D") for a in sys.argv[2:]):
        sys.exit(__doc__)
    build_image(SOURCE.read_bytes(), pathlib.Path(sys.argv[1]), sys.argv[2:])


if __name__ == "__main__":
    main()
