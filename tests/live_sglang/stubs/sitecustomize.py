"""Test-only stand-in (live SGLang on a CPU), loaded by the venv that scripts/sglang_cpu_env.sh builds.

Why: PyPI's torch 2.14.1 is a CUDA build; with no GPU, `torch.get_device_module()` still answers `torch.cuda`,
and sglang's `release_memory_occupation` calls its `.synchronize()` ("Found no NVIDIA driver"). Where CUDA is
unavailable it answers `torch.cpu`, patched right after torch is imported (no torch import at start-up here).
Likewise sglang's LoRA modules (`sglang.srt.lora.*`) allocate their offset tables with `pin_memory=True`
(page-locked host memory for CUDA copies, which needs the driver): with no GPU, those modules get a `torch` whose
factories ignore `pin_memory`, and `Tensor.pin_memory` returns a plain copy. Only the LoRA modules: replacing
`torch.tensor` everywhere breaks the full-weight push (seen: the engine's weights no longer matched the trainer's).
"""

import importlib.abc
import importlib.machinery
import sys
import types

FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided")


class _UnpinnedTorch(types.ModuleType):
    """`torch` as the LoRA modules see it on a CPU: every attribute torch's own, the factories without pinning."""

    def __init__(self, torch):
        super().__init__("torch")
        self._torch = torch
        for name in FACTORIES:
            setattr(self, name, self._unpinned(getattr(torch, name)))

    @staticmethod
    def _unpinned(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)
        return make

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _patch_torch(torch) -> None:
    original = torch.get_device_module

    def get_device_module(device=None):
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return original(device)

    torch.get_device_module = get_device_module
    if not torch.cuda.is_available():  # a copy, as real pinning makes
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()


def _patch_lora_module(module) -> None:
    torch = sys.modules["torch"]
    if getattr(module, "torch", None) is torch and not torch.cuda.is_available():
        module.torch = _UnpinnedTorch(torch)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after torch, and after each of sglang's LoRA modules, is imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            patch = _patch_torch
        elif name.startswith("sglang.srt.lora.") or name == "sglang.srt.lora":
            patch = _patch_lora_module
        else:
            return None
        spec = self._find_after(name, path, target)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
        return spec

    def _find_after(self, name, path, target):
        """The spec the finders after this one give."""
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


sys.meta_path.insert(0, _AfterImport())
