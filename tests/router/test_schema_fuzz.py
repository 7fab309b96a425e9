"""schemathesis against the router's own OpenAPI document: no server error.

Bodies generated from `/openapi.json` (`common.api.schemas`), both schema-valid (positive) and
schema-violating (negative), go to every endpoint of a real router (`RouterThread`) with a fake
decode worker; the only check is schemathesis's `not_a_server_error`: no 5xx, whatever is sent.
A small `--max-model-len` keeps generated requests short (the fake worker emits every token).
The example count is bounded (`EXAMPLES` per mode, about 20 s on a loaded 2-core machine).
"""

from __future__ import annotations

import pytest

from tests.router.fake_worker import RouterThread

schemathesis = pytest.importorskip("schemathesis")  # the dev extra installs it

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (after the skip)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = 60


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(mode: GenerationMode) -> None:
    with RouterThread(colocated=True, max_model_len=64) as router:
        router.worker("decode", "d0", token_delay_s=0.0, answer_block_books=True)
        schema = schemathesis.openapi.from_url(router.url + "/openapi.json")
        calls: list[tuple[str, str, int]] = []

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,  # no example database written into the tree
            derandomize=True,  # the same examples every run: a failure reproduces
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema.as_strategy(mode))
        def fuzz(case) -> None:  # noqa: ANN001  (schemathesis' Case)
            response = case.call_and_validate(
                base_url=router.url, checks=[not_a_server_error], timeout=30
            )
            calls.append((case.method, case.path, response.status_code))

        fuzz()
        assert len(calls) >= EXAMPLES // 2  # it really sent requests
        assert all(code < 500 for _, _, code in calls)
        # valid bodies were served, invalid ones refused
        if mode == GenerationMode.POSITIVE:
            assert any(code == 200 for *_, code in calls)
        else:
            assert any(400 <= code < 500 for *_, code in calls)
