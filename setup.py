"""Build of fused_dense's extension, fused_dense._C, holding the op registrations (the package
metadata is in pyproject.toml).

Install against the torch already in the environment:
    pip install --no-build-isolation .          (or -e . for development)
Environment:
    FUSED_DENSE_CPU_ONLY=1     build without CUDA (CPU + Meta kernels only); automatic when no
                               CUDA toolkit is found
    FUSED_DENSE_CUDA_ARCHS     semicolon list of compute capabilities, default "8.0;9.0a"
                               (SASS for each, PTX for the highest); 9.0a (Hopper's arch-specific
                               features) is what the cutlass_sm90 kernels need, 9.0 leaves it out
    CUTLASS_PATH               a CUTLASS checkout (its include/ and tools/util/include/); by default
                               the headers of the nvidia-cutlass package, when installed. Without
                               them the cutlass_sm90 kernels are left out (the library works without it)
    MAX_JOBS                   parallel compile jobs (ninja)
"""
import glob
import os

from setuptools import setup

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
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


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


# Every csrc/torch source is part of the build, its cuda/ folder (the CUDA kernels) only with CUDA
# (csrc/torch/README.md).
cuda_torch_sources = _sources("csrc/torch/cuda/*.cpp")
torch_sources = [s for s in _sources("csrc/torch/**/*.cpp") if s not in cuda_torch_sources]
# The core's plain C++ vocabulary (names of the codes), which the CPU kernels' messages use too.
CORE_HOST_SOURCES = ["csrc/core/common/types.cpp"]
# Includes are written from csrc/ ("core/common/types.h"), by folder; csrc/core's folders are its
# layers (docs/contract.md, "Layers").
INCLUDE_DIRS = [os.path.join(ROOT, "csrc")]
cxx_flags = ["-O3", "-std=c++17"]

if _want_cuda():
    sources = torch_sources + cuda_torch_sources + _sources("csrc/core/**/*.cpp") + _sources("csrc/core/**/*.cu")
    archs = _cuda_archs()
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo"] + _gencode_flags(archs)
    include_dirs = list(INCLUDE_DIRS)
    cutlass = _cutlass_includes()
    cxx = list(cxx_flags)
    if cutlass and "90a" in archs:
        include_dirs += cutlass
        nvcc_flags.append("-DFUSED_DENSE_WITH_CUTLASS_SM90A")
        cxx.append("-DFUSED_DENSE_WITH_CUTLASS_SM90A")  # cutlass_gemms_compiled() in csrc/torch/constants.cpp
    else:
        print("fused_dense: building without the cutlass_sm90 kernels (" +
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
    ext = cpp_extension.CppExtension(name="fused_dense._C", sources=torch_sources + CORE_HOST_SOURCES,
                                     include_dirs=INCLUDE_DIRS,
                                     extra_compile_args={"cxx": cxx_flags})



def _refuse_isolated_build():
    """A build-isolated torch (pip's temporary build environment) is not the torch the package
    will run with, and the extension's C++ ABI is tied to one torch release."""
    if "pip-build-env" in torch.__file__ or "build-env-" in torch.__file__:
        raise SystemExit(
            "fused_dense must be built against the torch it will run with, but this build is "
            f"isolated (torch {torch.__version__} from {os.path.dirname(torch.__file__)}). Install torch "
            "first, then: pip install --no-build-isolation .")


def _write_build_info():
    """fused_dense/_build_info.py: what this build was compiled against, checked at import."""
    with open(os.path.join(ROOT, "fused_dense", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write(f"TORCH_VERSION = {torch.__version__!r}\n")
        f.write(f"CUDA_KERNELS = {_want_cuda()!r}\n")


_refuse_isolated_build()
_write_build_info()

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
