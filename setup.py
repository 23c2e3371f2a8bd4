"""Build of fused_dense: one extension, fused_dense._C, holding the op registrations.

Install against the torch already in the environment:
    pip install --no-build-isolation .          (or -e . for development)
Environment:
    FUSED_DENSE_CPU_ONLY=1     build without CUDA (CPU + Meta kernels only); automatic when no
                               CUDA toolkit is found
    FUSED_DENSE_CUDA_ARCHS     semicolon list of compute capabilities, default "8.0;9.0a"
                               (SASS for each, PTX for the highest); 9.0a (Hopper's arch-specific
                               features) is what fused_dense's own CUTLASS GEMM needs, 9.0 leaves it out
    CUTLASS_PATH               a CUTLASS checkout (its include/ and tools/util/include/); by default
                               the headers of the nvidia-cutlass package, when installed. Without
                               them the own GEMM is left out (the library works without it)
    MAX_JOBS                   parallel compile jobs (ninja)
"""
import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:  # pragma: no cover - build-time guidance only
    raise SystemExit(
        "fused_dense builds against an installed PyTorch: install torch first, then "
        "`pip install --no-build-isolation .`"
    ) from exc

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda():
    if os.environ.get("FUSED_DENSE_CPU_ONLY", "0") == "1":
        return False
    return cpp_extension.CUDA_HOME is not None


def _cuda_archs():
    archs = os.environ.get("FUSED_DENSE_CUDA_ARCHS", "8.0;9.0a").split(";")
    return [a.strip().replace(".", "") for a in archs if a.strip()]


def _gencode_flags(nums):
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in nums]
    # PTX of the highest plain arch: arch-specific (9.0a) PTX does not run on later GPUs
    ptx = max(int(n.rstrip("a")) for n in nums)
    flags.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
    return flags


def _cutlass_includes():
    """CUTLASS's include directories, or None."""
    root = os.environ.get("CUTLASS_PATH")
    if not root:
        try:
            import cutlass_library
        except ImportError:
            return None
        root = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
    dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    return dirs if os.path.isfile(os.path.join(dirs[0], "cutlass", "cutlass.h")) else None


torch_sources = ["csrc/torch/registration.cpp", "csrc/torch/checks.cpp", "csrc/torch/reference.cpp",
                 "csrc/torch/meta.cpp", "csrc/torch/autograd_guard.cpp", "csrc/torch/mlp_autograd.cpp"]
cxx_flags = ["-O3", "-std=c++17"]

if _want_cuda():
    sources = torch_sources + ["csrc/torch/cuda_ops.cpp"] + _sources("csrc/core/*.cpp") + _sources("csrc/core/*.cu")
    archs = _cuda_archs()
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo"] + _gencode_flags(archs)
    include_dirs = []
    cutlass = _cutlass_includes()
    cxx = list(cxx_flags)
    if cutlass and "90a" in archs:
        include_dirs += cutlass
        nvcc_flags.append("-DFUSED_DENSE_WITH_CUTLASS_SM90A")
        cxx.append("-DFUSED_DENSE_WITH_CUTLASS_SM90A")  # own_gemm_compiled() in registration.cpp
    else:
        print("fused_dense: building without the own CUTLASS GEMM (" +
              ("needs 9.0a in FUSED_DENSE_CUDA_ARCHS" if cutlass else
               "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 --no-deps, or set CUTLASS_PATH") + ")")
    ext = cpp_extension.CUDAExtension(
        name="fused_dense._C",
        sources=sources,
        include_dirs=include_dirs,
        libraries=["cublasLt"],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc_flags},
    )
else:
    ext = cpp_extension.CppExtension(name="fused_dense._C", sources=torch_sources,
                                     extra_compile_args={"cxx": cxx_flags})

setup(
    name="fused_dense",
    version="0.1.0",
    description="Fused GEMM + bias + activation (cuBLASLt) dense layers for PyTorch training",
    packages=find_packages(include=["fused_dense", "fused_dense.*", "fused_dense_lib"]),
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
)
