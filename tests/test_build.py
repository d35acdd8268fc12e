"""The build tells the truth: CUDA and NCCL are compiled in exactly when it says so
(the shared object's NEEDED libraries are the independent witness), the NCCL it
links is the one torch loads, and setup.py refuses a CUDA build it cannot make
(CPU-only with a warning saying why; an error when forced).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pyddp import _C


def _needed_libraries(path: str) -> set:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return {line.split("[", 1)[1].split("]", 1)[0]
            for line in out.stdout.splitlines() if "(NEEDED)" in line}


def test_has_cuda_matches_the_shared_object():
    assert shutil.which("readelf"), "readelf (binutils) is needed to inspect the extension"
    needed = _needed_libraries(_C.__file__)
    assert isinstance(_C.has_cuda, bool)
    assert _C.has_cuda == ("libnccl.so.2" in needed), needed
    assert _C.has_cuda == ("libc10_cuda.so" in needed), needed
    assert not _C.has_cuda or torch.version.cuda is not None
    assert hasattr(_C, "NcclEngine") == _C.has_cuda
    assert hasattr(_C, "nccl_version") == _C.has_cuda


@pytest.mark.skipif(not _C.has_cuda, reason="CPU-only build of pyddp: no NCCL compiled in")
def test_nccl_version_is_the_one_torch_loads():
    version = _C.nccl_version()
    assert version == tuple(torch.cuda.nccl.version())
    assert version >= (2, 10, 0)
    try:
        wheel = importlib.metadata.version(f"nvidia-nccl-cu{torch.version.cuda.split('.')[0]}")
    except importlib.metadata.PackageNotFoundError:
        return  # torch found NCCL elsewhere (PYDDP_NCCL_HOME builds); torch's is checked above
    assert ".".join(map(str, version)) == wheel


def _setup_py(env: dict, tmp_path) -> subprocess.CompletedProcess:
    """Runs setup.py's build planning only (``--name``) with `env` added."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


def test_setup_refuses_a_cuda_build_it_cannot_make(tmp_path):
    """A toolkit whose major version differs from torch's: a CPU-only build
    with a warning saying why; forced with PYDDP_BUILD_CUDA=1, an error."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    other = int(torch.version.cuda.split(".")[0]) - 1 if torch.version.cuda else 12
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {other}.4, V{other}.4.1'\n")
    nvcc.chmod(0o755)
    env = {"CUDA_HOME": str(tmp_path)}
    planned = _setup_py(env, tmp_path)
    assert planned.returncode == 0, planned.stderr
    forced = _setup_py({**env, "PYDDP_BUILD_CUDA": "1"}, tmp_path)
    assert forced.returncode != 0
    if torch.version.cuda:
        why = (f"nvcc in {tmp_path} is CUDA {other}.4 but torch was built with CUDA "
               f"{torch.version.cuda}")
        assert "building the CPU-only extension (no CUDA, no NCCL): " + why in planned.stderr
    else:
        why = f"torch {torch.__version__} is a CPU build"
        assert "CPU-only extension" not in planned.stderr, planned.stderr
    assert "PYDDP_BUILD_CUDA=1, but the CUDA build is impossible: " + why in forced.stderr
