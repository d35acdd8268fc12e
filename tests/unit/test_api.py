"""pyddp's public surface: the names it exports, its version, and the typed face of _C.

The stub pyddp/_C.pyi is what type checkers and readers see of the C++ core:
every name it declares must exist in the built module (CUDA-only names in CUDA
builds), and every public name of the module must be declared.
"""

import ast
import os

import torch

import pyddp
from pyddp import _C

STUB = os.path.join(os.path.dirname(pyddp.__file__), "_C.pyi")
CUDA_ONLY = {"nccl_version", "NcclEngine"}


def _stub_names():
    tree = ast.parse(open(STUB).read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return names


def test_the_stub_declares_the_module():
    declared = _stub_names()
    built = {n for n in dir(_C) if not n.startswith("_")}
    expected = declared if _C.has_cuda else declared - CUDA_ONLY
    assert built == expected, (sorted(built - expected), sorted(expected - built))


def test_public_names():
    for name in pyddp.__all__:
        assert hasattr(pyddp, name), name
    assert pyddp.Algo is _C.Algo and pyddp.SlotStores is _C.SlotStores
    # The options' earlier name stays, for code written with it.
    assert pyddp.GroupOptions is _C.GroupOptions and pyddp.RingOptions is pyddp.GroupOptions
    assert pyddp.has_cuda() is _C.has_cuda
    assert isinstance(pyddp.__version__, str) and pyddp.__version__.count(".") == 2
    assert tuple(_C.backend_names()) == pyddp.BACKENDS


def test_the_extension_matches_the_running_torch():
    assert _C.torch_version == torch.__version__.split("+")[0]


def test_engines_share_one_base_class():
    assert issubclass(_C.TransportEngine, _C.Engine)
    assert issubclass(_C.Engine, torch._C._distributed_c10d.Backend)
    if _C.has_cuda:
        assert issubclass(_C.NcclEngine, _C.Engine)
