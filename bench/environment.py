"""What ran: GPU, driver, torch, CUDA, cuBLASLt, triton and torchao versions, the source tree id."""
import ctypes
import datetime
import glob
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile

import torch

from bench import power

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args, env=None, timeout=60):
    try:
        res = subprocess.run(["git", "-C", ROOT, *args], env=env, capture_output=True, text=True,
                             timeout=timeout, check=True)
        return res.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def source_tree_id():
    """git's tree id of the files as they are (tracked and untracked-not-ignored, through a
    throw-away index), whatever HEAD says: it names the tree that ran even in a copy whose .git
    lags its files, and equals `git rev-parse <commit>^{tree}` of the commit those files are."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
        if _git("add", "-A", env=env) is None:
            return None
        tree = _git("write-tree", env=env)
    return tree if tree and len(tree) == 40 else None


def cublaslt_version():
    """cublasLtGetVersion() of the libcublasLt this process has loaded (from /proc/self/maps), else
    of the first one found beside torch."""
    try:
        with open("/proc/self/maps") as f:
            paths = list(dict.fromkeys(ln.split()[-1] for ln in f if "libcublasLt" in ln))
    except OSError:
        paths = []
    loaded = bool(paths)
    for sp in [os.path.dirname(torch.__file__)] + sys.path:
        paths += glob.glob(os.path.join(sp, "lib", "libcublasLt.so*"))
        paths += glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libcublasLt.so*"))
    for p in paths + ["libcublasLt.so"]:
        try:
            lib = ctypes.CDLL(p)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            v = int(lib.cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
        return {"cublasLt_version": v, "cublasLt_version_str": f"{v // 10000}.{(v % 10000) // 100}.{v % 100}",
                "cublasLt_path": p, "cublasLt_loaded_by_process": loaded}
    return {"cublasLt_version": None, "cublasLt_version_str": None}


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def _dist_version(name):
    """An installed distribution's version without importing it (None if not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device, argv, commit=None, fused_dense_import_error=None):
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": argv, "python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": str(device),
           "fused_dense_import_error": fused_dense_import_error, "triton": _version("triton"),
           "flash_attn": _version("flash_attn"), "fused_dense": _version("fused_dense"),
           "torchao": _dist_version("torchao"), "transformers": _dist_version("transformers")}
    try:
        import fused_dense
        env["fused_dense_cuda_kernels"] = bool(fused_dense.has_cuda_kernels())
    except Exception:  # noqa: BLE001
        pass
    # The commit: the caller's, else $FUSED_DENSE_COMMIT (a copy of a tree whose .git lags its files,
    # as on the GPU machine), else HEAD. Dirtiness is HEAD's against the files, so it is recorded
    # only where the commit is HEAD; git_tree identifies the files either way.
    head = (_git("rev-parse", "HEAD", timeout=20) or "").strip().lower()
    commit = (commit or os.environ.get("FUSED_DENSE_COMMIT") or head).strip().lower()
    ok = 7 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit)
    env["git_commit"] = commit if ok else None
    status = _git("status", "--porcelain", "--untracked-files=no", timeout=20) if ok and head.startswith(commit) else None
    env["git_dirty"] = None if status is None else bool(status)
    env["git_tree"] = source_tree_id()
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   gpu_memory_gib=round(p.total_memory / 1024 ** 3, 1), cudnn=torch.backends.cudnn.version())
        try:
            env["cuda_driver_api"] = int(torch._C._cuda_getDriverVersion())
        except Exception:  # noqa: BLE001
            pass
        env.update(power.gpu_state(device.index or 0))
    else:
        env["cpu_threads"] = torch.get_num_threads()
    env.update(cublaslt_version())
    return env
