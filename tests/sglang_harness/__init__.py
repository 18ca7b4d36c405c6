"""Test harness for running SGLang's attention stack where `sgl_kernel` cannot be installed.

`sgl_kernel` (sglang-kernel, 373 MB) does not fit the lent H200's 64 MiB carry, and SGLang imports it without
a guard on CUDA. `install_sgl_kernel_shim()` provides, only when the real package is absent, the names SGLang's
import chain for the Triton attention backend, the MLA KV pool and the attention test kit asks of it:

- `sgl_kernel.utils.is_arch_support_pdl()`: the real one's answer, compute capability major >= 9 of the
  current device (True on the H200);
- every other name in `OPS`: an op the import chain binds but the attention path never calls; calling it
  raises, so a test that reached one would fail instead of computing something else.

Any other name raises AttributeError (ImportError for `from sgl_kernel import x`), as a missing op would.
With `KDTREE_SGL_KERNEL_DISCOVER=1` every name is answered with a raising op and recorded in `REQUESTED`
(how `OPS` was found: `scripts/sglang_imports.py`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

OPS: frozenset[str] = frozenset()
REQUESTED: list[str] = []


@functools.cache
def is_arch_support_pdl() -> bool:
    major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    return major >= 9


ANSWERS = {"sgl_kernel.utils.is_arch_support_pdl": is_arch_support_pdl}


def _missing_op(fullname: str):
    def op(*args, **kwargs):
        raise RuntimeError(f"{fullname} is a sgl_kernel op this test harness does not provide")

    op.__name__ = op.__qualname__ = fullname.rsplit(".", 1)[-1]
    return op


class _ShimModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        fullname = f"{self.__name__}.{name}"
        if fullname in ANSWERS:
            return ANSWERS[fullname]
        discover = os.environ.get("KDTREE_SGL_KERNEL_DISCOVER") == "1"
        if discover:
            REQUESTED.append(fullname)
        if discover or fullname in OPS:
            value = _missing_op(fullname)
            setattr(self, name, value)
            return value
        raise AttributeError(f"module {self.__name__!r} (kdtree's test shim) has no attribute {name!r}")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_sgl_kernel_shim() -> bool:
    """Provide the shim when the real sgl_kernel is not installed; True when the shim is in place."""
    if any(isinstance(f, _ShimFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.meta_path.insert(0, _ShimFinder())
    return True
