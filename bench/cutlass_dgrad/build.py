"""Builds the CUTLASS fused-dgrad probe into .prebuilt_probe/ (an ignored folder carried to the GPU
machine). Needs the CUDA toolkit and CUTLASS's headers: `pip install nvidia-cutlass==4.2.0.0
--no-deps` puts them in cutlass_library/source. sm_90a only: the kernels use Hopper's wgmma/TMA.

    python bench/cutlass_dgrad/build.py      (about 7 minutes on 2 cores)
"""
import os
import shutil

import cutlass_library
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CUTLASS = os.path.join(os.path.dirname(cutlass_library.__file__), "source")


def main():
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    build_dir = os.path.join(ROOT, "build", "cutlass_dgrad_probe")
    os.makedirs(build_dir, exist_ok=True)
    sources = [os.path.join(HERE, f) for f in
               ("registration.cpp", "dispatch.cpp") + tuple(f"config_{i}.cu" for i in range(7))]
    includes = [os.path.join(CUTLASS, "include"), os.path.join(CUTLASS, "tools", "util", "include"), HERE,
                os.path.join(ROOT, "csrc", "core")]
    lib = cpp_extension.load(
        name="fused_dense_cutlass_probe", sources=sources, extra_include_paths=includes,
        extra_cflags=["-O3", "-std=c++17", "-DNDEBUG"],
        # NDEBUG matters: an assert in device code is a call, and ptxas then serializes wgmma
        extra_cuda_cflags=["-O3", "-std=c++17", "-DNDEBUG", "--expt-relaxed-constexpr", "-lineinfo"],
        build_directory=build_dir, is_python_module=False, verbose=True)
    out_dir = os.path.join(ROOT, ".prebuilt_probe")
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, "fused_dense_cutlass_probe.so")
    shutil.copy(lib if isinstance(lib, str) else os.path.join(build_dir, "fused_dense_cutlass_probe.so"), target)
    print("built", target)


if __name__ == "__main__":
    main()
