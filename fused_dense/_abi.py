"""The extension is compiled against one torch release and only runs with that one (C++ ABI).

setup.py writes fused_dense/_build_info.py at build time; importing fused_dense compares it with
the torch that is running and stops with both versions named, instead of a crash or an
undefined-symbol error from the loader.
"""
import torch


def check_torch_version() -> None:
    try:
        from . import _build_info
    except ImportError:  # a source tree that was never built: the loader says how to build
        return
    built, running = _build_info.TORCH_VERSION, torch.__version__
    if _release(built) != _release(running):
        raise ImportError(
            f"fused_dense was built against torch {built} but torch {running} is running; the "
            f"extension only works with the torch it was compiled with. Rebuild it in this "
            f"environment: pip install --no-build-isolation --force-reinstall --no-deps .")


def _release(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0': the local tag (CUDA flavour) does not change the C++ ABI."""
    return version.split("+")[0]
