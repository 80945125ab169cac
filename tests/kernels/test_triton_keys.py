"""harness.kernels._triton.source_text_key: a timing pairs with kernel code by its text, so the key must move when
a kernel's text does and stay when only its lines move (Triton's own cache_key moves with the line number)."""

from __future__ import annotations

import importlib.util
import sys

import triton  # noqa: F401  (the module below builds @triton.jit functions)

from harness.kernels._triton import source_text_key

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _helper(x):
    return x + 1


@triton.jit
def _kernel(ptr):
    tl.store(ptr, _helper(tl.load(ptr)))


def not_a_kernel():
    return 0
'''


def _load(tmp_path, file, text, name="keys_module"):
    """``text`` as module ``name`` from its own file (one name for every version: the name is part of the key)."""
    path = tmp_path / f"{file}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _key(tmp_path, file, text, name="keys_module"):
    return source_text_key(_load(tmp_path, file, text, name)._kernel)


def test_the_key_follows_the_kernels_text_not_their_lines(tmp_path):
    base = _key(tmp_path, "base", KERNEL)
    docstring = '"""A longer docstring\n\nthat moves every line."""\n'
    assert _key(tmp_path, "moved", docstring + KERNEL) == base                                # lines moved
    assert _key(tmp_path, "edited", KERNEL.replace("x + 1", "x + 2")) != base                 # a helper's text
    assert _key(tmp_path, "plain", KERNEL.replace("return 0", "return 1")) == base            # not Triton
    assert _key(tmp_path, "renamed", KERNEL, name="keys_other") != base                       # another module
