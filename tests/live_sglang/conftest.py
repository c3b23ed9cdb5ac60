"""Live SGLang tests: no engine process outlives the tests, on failures too."""

import pytest

from sglang_live import SKIP_REASON, kill_children


@pytest.fixture(scope="module", autouse=True)
def no_orphans():
    yield
    if SKIP_REASON is None:
        kill_children()
