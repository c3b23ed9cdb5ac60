"""Test-only stand-in (live SGLang on a CPU), loaded by the venv that scripts/sglang_cpu_env.sh builds.

Why: PyPI's torch 2.14.1 is a CUDA build; with no GPU, `torch.get_device_module()` still answers `torch.cuda`,
and sglang's `release_memory_occupation` calls its `.synchronize()` ("Found no NVIDIA driver"). Where CUDA is
unavailable it answers `torch.cpu`, patched right after torch is imported (no torch import at start-up here).
Likewise sglang's LoRA layers allocate their offset tables with `pin_memory=True` (page-locked host memory for
CUDA copies, which needs the driver): with no GPU, pinning is a no-op here (plain host memory, same values).
"""

import importlib.abc
import importlib.machinery
import sys


def _patch(torch) -> None:
    original = torch.get_device_module

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device)

    torch.get_device_module = get_device_module
    if torch.cuda.is_available():
        return

    def unpinned(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)
        return make

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided"):
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


class _AfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())
