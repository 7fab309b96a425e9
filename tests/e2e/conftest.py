"""Fixtures of the end-to-end tests, and the `e2e` marker on every test in this folder.

Every test here starts real processes (router, workers, `pdserve` commands), so all of them carry
the `e2e` marker that `make test-fast` deselects. `chat_model_dir` is a small random-weight Llama
that carries the default model's real tokenizer and chat template (tests/tiny_models.py): fast
enough for many multi-process tests while keeping real text in and out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import build_tiny_chat_model

_HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's hook sees every collected item, not only this folder's: filter by path.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-llama"))
