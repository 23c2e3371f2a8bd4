"""The package's version source and its refusal to run with a torch it was not built against."""
import os
import re

import pytest
import torch

import fused_dense
from fused_dense import _abi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_version_source():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "fused_dense._version.__version__" }' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", fused_dense.__version__)
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"## {fused_dense.__version__}" in f.read()


def test_build_info_names_the_running_torch():
    from fused_dense import _build_info
    assert _abi._release(_build_info.TORCH_VERSION) == _abi._release(torch.__version__)
    assert _build_info.CUDA_KERNELS == fused_dense.has_cuda_kernels()


def test_other_torch_release_is_refused_naming_both(monkeypatch):
    from fused_dense import _build_info
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "2.3.1+cu121")
    with pytest.raises(ImportError) as err:
        _abi.check_torch_version()
    msg = str(err.value)
    assert "built against torch 2.3.1+cu121" in msg and f"torch {torch.__version__} is running" in msg
    assert "--no-build-isolation" in msg


def test_local_tag_alone_is_accepted(monkeypatch):
    from fused_dense import _build_info
    monkeypatch.setattr(_build_info, "TORCH_VERSION", _abi._release(torch.__version__) + "+cpu")
    _abi.check_torch_version()
