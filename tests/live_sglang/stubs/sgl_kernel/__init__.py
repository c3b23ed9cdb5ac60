"""Test-only stand-in for `sgl_kernel` (live SGLang on a CPU), on the path of scripts/sglang_cpu_env.sh's venv only.

Why: PyPI's sglang-kernel is CUDA-only (its ops library needs libcuda.so.1) and has no CPU build or sdist, yet
sglang's CPU mode imports a few of its `*_cpu` ops at module level (KV-cache moves, request-to-token pool
assignment, speculative decoding). On a CPU without AMX the model layers take sglang's torch-native path and
call none of them, so every name resolves to a function that raises if it is ever called.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+lit-rlvr-cpu-stand-in"


class _Missing:
    """Any name of sgl_kernel: its attributes are more of the same (module-level `scalar_types.uint4b8` reads
    work), and calling one raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._qualname} is a test stand-in (tests/live_sglang/stubs): sglang called "
                                  "a sgl_kernel op that has no CPU build here")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


def _ops_of(module_name: str):
    """A module `__getattr__`: every public name is a raising op (dunder look-ups stay AttributeErrors)."""

    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{module_name}.{name}")

    return getattr_


__getattr__ = _ops_of(__name__)


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`sgl_kernel.<anything>` is a module of the same raising ops."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _ops_of(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
