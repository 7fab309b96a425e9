"""The default model as transformers' own GGUF loader builds it, once for this folder.

The load dequantizes every tensor in Python: about a minute on a 2-core host, so test_weights
(our weights against its) and test_default_model (our tokens against its greedy output) share one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.model.model_files import resolve_model


@pytest.fixture(scope="package")
def hf_default_model() -> torch.nn.Module:
    """The float32 model in eval mode; tests only read it (generate, state_dict)."""
    source = resolve_model("default")
    return AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32
    ).eval()
