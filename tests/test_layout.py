"""The source tree's layers (docs/contract.md, "Layers"): csrc/core's folders, each including only
itself and the folders below it, no PyTorch header in csrc/core, and csrc/torch reaching the core
only by folder paths. Read from the files, so the rule holds for every source without a build."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "core")

# csrc/core's folders from the bottom up: a file may include its own folder and those before it.
CORE_LAYERS = ["common", "gemm", "tuning", "elementwise", "cutlass_sm90", "ops"]
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def _sources(top):
    for dirpath, _, names in os.walk(top):
        for name in sorted(names):
            if name.endswith(SOURCE_SUFFIXES):
                yield os.path.join(dirpath, name)


def _includes(path):
    with open(path) as f:
        return INCLUDE.findall(f.read())


def test_core_is_only_folders_of_the_known_layers():
    entries = sorted(os.listdir(CORE))
    assert entries == sorted(CORE_LAYERS), f"csrc/core holds {entries}; expected the layer folders {CORE_LAYERS}"
    for layer in CORE_LAYERS:
        assert list(_sources(os.path.join(CORE, layer))), f"csrc/core/{layer} has no sources"


@pytest.mark.parametrize("layer", CORE_LAYERS)
def test_core_folder_includes_only_itself_and_layers_below(layer):
    allowed = CORE_LAYERS[: CORE_LAYERS.index(layer) + 1]
    bad = []
    for path in _sources(os.path.join(CORE, layer)):
        rel = os.path.relpath(path, ROOT)
        for kind, target in _includes(path):
            if kind == "<":
                if target.split("/")[0] in ("torch", "ATen", "c10", "pybind11"):
                    bad.append(f"{rel}: PyTorch header <{target}> (csrc/core is torch-free)")
                continue
            parts = target.split("/")
            if parts[0] != "core" or len(parts) != 3:
                bad.append(f'{rel}: "{target}" is not written as "core/<layer>/<file>"')
            elif parts[1] not in allowed:
                bad.append(f'{rel}: "{target}" reaches up from {layer} to {parts[1]}')
            elif not os.path.isfile(os.path.join(ROOT, "csrc", target)):
                bad.append(f'{rel}: "{target}" does not exist')
    assert not bad, "\n".join(bad)


def test_torch_bindings_reach_the_core_by_folder_paths():
    bad = []
    for path in _sources(os.path.join(ROOT, "csrc", "torch")):
        rel = os.path.relpath(path, ROOT)
        for kind, target in _includes(path):
            if kind == '"' and ".." in target.split("/"):
                bad.append(f'{rel}: "{target}" (write core headers as "core/<layer>/<file>")')
            if kind == '"' and target.startswith("core/") and not os.path.isfile(os.path.join(ROOT, "csrc", target)):
                bad.append(f'{rel}: "{target}" does not exist')
    assert not bad, "\n".join(bad)


def test_layer_check_catches_an_upward_include(tmp_path):
    """The folder rule above, applied to a planted file, must see a reach upward."""
    fake = tmp_path / "gemm.cpp"
    fake.write_text('#include "core/common/types.h"\n#include "core/ops/linear.h"\n')
    targets = [t for _, t in _includes(str(fake))]
    allowed = CORE_LAYERS[: CORE_LAYERS.index("gemm") + 1]
    assert [t for t in targets if t.split("/")[1] not in allowed] == ["core/ops/linear.h"]
