"""Test-wide setup and the tiny-model fixtures.

Switches Triton to its interpreter on machines without CUDA, here because conftest.py is imported
before any test module and so before anything imports triton (the flag is read at triton's
import). The models themselves are defined in tests/tiny_models.py; these fixtures build them once
per session in a temp dir.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton kernels' tests then run on the CPU, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import FAMILIES, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_model(request, tmp_path_factory):
    """(family, HF model, model dir) for each supported family."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, build_tiny_model(request.param, path), path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(HF model, model dir) of the plain Llama family."""
    path = tmp_path_factory.mktemp("llama-single")
    return build_tiny_model("llama", path), path


@pytest.fixture(autouse=True)
def _cpu_activations_default():
    """An engine sets cpu_quant's process-wide activation mode and kernel choice (and its tuned
    tables) from its config: every test starts from the defaults, whatever the one before built."""
    from common.kernels import cpu_quant

    cpu_quant.activations = "auto"
    cpu_quant.kernel_choice = "auto"
    cpu_quant.set_dense_weights(False)
    cpu_quant.set_uniform_rows(False)
    cpu_quant.tuned.clear()
    yield
