"""The source tree's layers (docs/contract.md, "Layers"): csrc/core's folders, each including only
itself and the folders below it, no PyTorch header in csrc/core, csrc/torch reaching the core only
by folder paths, and csrc/torch's one organising rule (csrc/torch/README.md): a file per op family
holding its schemas, the backends beside it by folder. Read from the files, so the rules hold for
every source without a build."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "csrc", "core")
TORCH = os.path.join(ROOT, "csrc", "torch")

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
    for path in _sources(TORCH):
        rel = os.path.relpath(path, ROOT)
        for kind, target in _includes(path):
            if kind != '"':
                continue
            if target.split("/")[0] not in ("core", "torch") or ".." in target.split("/"):
                bad.append(f'{rel}: "{target}" (write "core/<layer>/<file>" or "torch/<path>", from csrc/)')
            elif not os.path.isfile(os.path.join(ROOT, "csrc", target)):
                bad.append(f'{rel}: "{target}" does not exist')
    assert not bad, "\n".join(bad)


def test_layer_check_catches_an_upward_include(tmp_path):
    """The folder rule above, applied to a planted file, must see a reach upward."""
    fake = tmp_path / "gemm.cpp"
    fake.write_text('#include "core/common/types.h"\n#include "core/ops/linear.h"\n')
    targets = [t for _, t in _includes(str(fake))]
    allowed = CORE_LAYERS[: CORE_LAYERS.index("gemm") + 1]
    assert [t for t in targets if t.split("/")[1] not in allowed] == ["core/ops/linear.h"]


# ---- csrc/torch: one file per op family, the backends beside it by folder

TORCH_FOLDERS = ("cpu", "meta", "cuda", "autograd")  # cuda/: compiled only in a CUDA build (setup.py)
# Sources that are no family's: the helpers every family's checks use, and the autograd guard with
# def_raw_op, the helper through which the family files define their raw ops (its m.def passes
# their schema on).
TORCH_SHARED = {"checks.cpp", os.path.join("autograd", "guard.cpp")}
SCHEMA_HELPER = os.path.join("autograd", "guard.cpp")
SCHEMA = re.compile(r"\bm\.def\(|\bdef_raw_op\(\s*m\b|\bTORCH_LIBRARY(_FRAGMENT)?\s*\(")
FRAGMENT = re.compile(r"\bTORCH_LIBRARY_FRAGMENT\s*\(\s*fused_dense\b")
# What a source outside cuda/ may include from the core: the plain C++ vocabulary that the
# CPU-only build compiles (setup.py's CORE_HOST_SOURCES).
CPU_BUILD_CORE_HEADERS = {"core/common/types.h"}


def _code(path):
    """The file without its comments (a schema named in a comment is no definition)."""
    with open(path) as f:
        return re.sub(r"//[^\n]*|/\*.*?\*/", "", f.read(), flags=re.S)


def family_rule_violations(top):
    """Where the tree under `top` (a csrc/torch) breaks the family rule; empty when it holds."""
    bad = []
    families = set()
    for name in sorted(os.listdir(top)):
        path = os.path.join(top, name)
        if os.path.isdir(path):
            if name not in TORCH_FOLDERS:
                bad.append(f"{name}/: not one of the backend folders {TORCH_FOLDERS}")
        elif name.endswith(".cpp") and name not in TORCH_SHARED:
            families.add(name[: -len(".cpp")])
            n = len(FRAGMENT.findall(_code(path)))
            if n != 1:
                bad.append(f"{name}: a family's schemas are registered in one TORCH_LIBRARY_FRAGMENT block, found {n}")
    for dirpath, _, names in os.walk(top):
        folder = os.path.relpath(dirpath, top)
        for name in sorted(names):
            if not name.endswith(SOURCE_SUFFIXES):
                continue
            rel = os.path.normpath(os.path.join(folder, name))
            path = os.path.join(dirpath, name)
            code = _code(path)
            at_top = folder == "."
            stem, ext = os.path.splitext(name)
            if ext == ".cpp" and not at_top and stem not in families and rel not in TORCH_SHARED:
                bad.append(f"{rel}: no family file {stem}.cpp at the top of csrc/torch")
            outside = not at_top or rel in TORCH_SHARED or ext != ".cpp"
            if outside and rel != SCHEMA_HELPER and SCHEMA.search(code):
                bad.append(f"{rel}: defines a schema outside a family file ({SCHEMA.search(code).group(0)})")
            if not rel.startswith("cuda" + os.sep):
                for kind, target in INCLUDE.findall(code):
                    cuda = target.split("/")[1:2] == ["cuda"] and target.split("/")[0] in ("ATen", "c10")
                    core = kind == '"' and target.startswith("core/") and target not in CPU_BUILD_CORE_HEADERS
                    if cuda or core or (kind == '"' and target.startswith("torch/cuda/")):
                        bad.append(f"{rel}: includes {target}, which only the CUDA build has (move it to cuda/)")
    return bad


def test_torch_follows_the_family_rule():
    assert os.path.isfile(os.path.join(TORCH, "README.md"))
    bad = family_rule_violations(TORCH)
    assert not bad, "\n".join(bad)


def test_setup_takes_the_cuda_sources_by_folder():
    with open(os.path.join(ROOT, "setup.py")) as f:
        text = f.read()
    assert '_sources("csrc/torch/cuda/*.cpp")' in text and '_sources("csrc/torch/**/*.cpp")' in text
    assert not re.search(r'"csrc/torch/[^"*]+\.cpp"', text), "setup.py names csrc/torch sources by hand"


def test_family_rule_check_catches_a_broken_tree(tmp_path):
    """The rule check above, applied to planted trees, must see each kind of break."""
    def tree(files):
        top = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        for rel, text in files.items():
            (top / rel).parent.mkdir(parents=True, exist_ok=True)
            (top / rel).write_text(text)
        return str(top)

    ok = {"linear.cpp": "TORCH_LIBRARY_FRAGMENT(fused_dense, m) {\n  def_raw_op(m, \"a(Tensor x) -> Tensor\");\n}\n",
          "checks.cpp": "// m.def( in a comment is no schema\n",
          "cpu/linear.cpp": "TORCH_LIBRARY_IMPL(fused_dense, CPU, m) { m.impl(\"a\", &a); }\n",
          "cuda/linear.cpp": '#include <ATen/cuda/CUDAContext.h>\n#include "core/ops/linear.h"\n'}
    assert family_rule_violations(tree(ok)) == []
    orphan = dict(ok, **{"cuda/gated.cpp": ""})
    assert family_rule_violations(tree(orphan)) == ["cuda/gated.cpp: no family file gated.cpp at the top of csrc/torch"]
    stray = dict(ok, **{"cpu/linear.cpp": 'TORCH_LIBRARY_FRAGMENT(fused_dense, m) { m.def("b() -> ()"); }\n'})
    assert [b.split(":")[0] for b in family_rule_violations(tree(stray))] == ["cpu/linear.cpp"]
    shared = dict(ok, **{"checks.cpp": 'void f(torch::Library& m) { def_raw_op(m, "c(Tensor x) -> Tensor"); }\n'})
    assert [b.split(":")[0] for b in family_rule_violations(tree(shared))] == ["checks.cpp"]
    two_blocks = dict(ok, **{"linear.cpp": ok["linear.cpp"] * 2})
    assert [b.split(":")[0] for b in family_rule_violations(tree(two_blocks))] == ["linear.cpp"]
    cuda_at_top = dict(ok, **{"meta/linear.cpp": '#include "core/ops/linear.h"\n'})
    assert [b.split(":")[0] for b in family_rule_violations(tree(cuda_at_top))] == ["meta/linear.cpp"]
    other_folder = dict(ok, **{"kernels/linear.cpp": ""})
    assert family_rule_violations(tree(other_folder))[0].startswith("kernels/")
