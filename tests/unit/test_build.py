"""The build tells the truth: CUDA and NCCL are compiled in exactly when it says so
(the shared object's NEEDED libraries are the independent witness), the NCCL it
links is the one torch loads, and setup.py refuses a CUDA build it cannot make
(CPU-only with a warning saying why; an error when forced). The extension uses the
process's C++ runtime, and pyddp refuses to load one that carries its own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import pyddp
from paths import REPO
from pyddp import _C
from pyddp._runtime import LINK_RUNTIME, RUNTIME, own_runtime


def _needed_libraries(path: str) -> set:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
    return {line.split("[", 1)[1].split("]", 1)[0]
            for line in out.stdout.splitlines() if "(NEEDED)" in line}


@pytest.mark.multiprocess
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
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)


@pytest.mark.multiprocess
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


def _defined_symbols(path: str) -> set:
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                         check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.multiprocess
def test_the_extension_uses_the_process_runtime():
    """NEEDED libstdc++.so.6 and no runtime of its own, and the path that crashed with two
    runtimes (a new group's layout, where the first integers of a process are written to a
    stream) formats its numbers. .ci/run builds the CUDA extension with a compiler that adds
    -static-libstdc++, so this runs against such a build too."""
    assert RUNTIME in _needed_libraries(_C.__file__)
    assert "_ZNSt6locale7classicEv" not in _defined_symbols(_C.__file__)
    assert own_runtime(_C.__file__) is None
    group = pyddp.new_group("shm", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        assert re.fullmatch(r"1 host: rank 0 on \S.*", group.layout()), group.layout()
    finally:
        pyddp.destroy_process_group(group)


_FORMATS = textwrap.dedent("""
    #include <cstring>
    #include <sstream>
    extern "C" int format(char* out, int n) {
      std::ostringstream s;
      s << 12345L;
      std::strncpy(out, s.str().c_str(), n);
      return static_cast<int>(s.str().size());
    }
""")


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory):
    """The same ten lines built as a shared object with libstdc++ linked dynamically, and
    statically (as a compiler wrapper that appends -static-libstdc++ builds it)."""
    assert shutil.which("g++"), "g++ builds pyddp, and these tests"
    d = tmp_path_factory.mktemp("runtimes")
    (d / "format.cpp").write_text(_FORMATS)
    built = {}
    for name, flags in (("shared", []), ("static", ["-static-libstdc++"])):
        built[name] = str(d / f"{name}.so")
        subprocess.run(["g++", "-shared", "-fPIC", "-O2", str(d / "format.cpp"), "-o",
                        built[name], *flags], check=True, timeout=120)
    return built


@pytest.mark.multiprocess
def test_own_runtime_tells_a_static_runtime_from_the_shared_one(runtimes):
    """readelf and nm are the witnesses; loading each after torch shows why it matters: the
    static one's integer comes out empty (g++ 12) or the process crashes (g++ 13)."""
    load = textwrap.dedent("""
        import ctypes, sys, torch
        out = ctypes.create_string_buffer(32)
        ctypes.CDLL(sys.argv[1]).format(out, 32)
        print(out.value.decode())
    """)
    shared, static = runtimes["shared"], runtimes["static"]
    assert own_runtime(shared) is None
    assert RUNTIME in _needed_libraries(shared)
    assert RUNTIME not in _needed_libraries(static)
    assert "_ZNSt6locale7classicEv" in _defined_symbols(static)
    why = own_runtime(static)
    assert why == (f"{static} carries its own C++ runtime: it does not load {RUNTIME} and it "
                   "defines std::locale::classic (libstdc++.a was linked into it). Its "
                   "compiler links libstdc++ statically (-static-libstdc++, or a libstdc++.a "
                   "first on its library path), which gives the process two C++ runtimes; "
                   "rebuild pyddp with pyddp's setup.py, which links libstdc++ dynamically "
                   "whatever the compiler adds, or with a compiler that does not add it")
    ran = {name: subprocess.run([sys.executable, "-c", load, path], capture_output=True,
                                text=True, timeout=120) for name, path in runtimes.items()}
    assert ran["shared"].returncode == 0 and ran["shared"].stdout == "12345\n", ran["shared"]
    assert ran["static"].returncode != 0 or ran["static"].stdout != "12345\n", ran["static"]


@pytest.mark.multiprocess
def test_setup_links_the_shared_runtime_whatever_the_compiler_picks(tmp_path):
    """Two compilers link libstdc++.a where nothing asks otherwise: a wrapper that appends
    -static-libstdc++, and one whose -B directory holds libstdc++.a alone (the vendor CUDA
    image's g++, where -lstdc++ finds the archive first). With the argument setup.py links
    with, each makes a module that loads the process's runtime."""
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True, check=True, timeout=60).stdout.strip()
    assert os.path.isabs(archive), f"g++ has no libstdc++.a ({archive})"
    gcc_dir = tmp_path / "gcc"
    gcc_dir.mkdir()
    (gcc_dir / "libstdc++.a").symlink_to(archive)
    (tmp_path / "format.cpp").write_text(_FORMATS)
    compilers = {"static": ["-static-libstdc++"], "archive first": [f"-B{gcc_dir}/"]}
    # (compiler, link arguments, whether the module carries its own runtime)
    cases = [("static", [], True), ("static", [LINK_RUNTIME], False),
             ("archive first", [], True), ("archive first", ["-lstdc++"], True),
             ("archive first", [LINK_RUNTIME], False)]
    for compiler, link, own in cases:
        module = str(tmp_path / "module.so")
        subprocess.run(["g++", *compilers[compiler], "-shared", "-fPIC", "-O2",
                        str(tmp_path / "format.cpp"), "-o", module, *link], check=True,
                       timeout=120)
        assert (own_runtime(module) is not None) == own, (compiler, link)


@pytest.mark.multiprocess
def test_import_refuses_an_extension_with_its_own_runtime(runtimes, tmp_path):
    """pyddp's Python files beside a module that carries its own runtime, as _C: the import
    fails naming the cause and the fix, before the module is loaded."""
    package = tmp_path / "pyddp"
    shutil.copytree(os.path.dirname(pyddp.__file__), package,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    module = package / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    shutil.copy(runtimes["static"], module)
    ran = subprocess.run([sys.executable, "-c", "import pyddp"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert ran.returncode == 1, ran
    assert (f"ImportError: pyddp's C++ extension cannot be loaded: {module} carries its own "
            "C++ runtime: it does not load libstdc++.so.6") in ran.stderr, ran.stderr
