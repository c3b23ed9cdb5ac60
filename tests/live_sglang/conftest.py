"""Live SGLang tests: the whole train.py runs start in the background with the session (train_runs.py), and no
engine process outlives the tests, on failures too."""

import pytest

from sglang_live import SKIP_REASON, kill_children


@pytest.fixture(scope="session", autouse=True)
def train_runs(request, tmp_path_factory):
    """The train.py runs of test_live_sglang_runs.py, started at once when a selected test there needs them."""
    wanted = [item for item in request.session.items if "runs" in item.fixturenames
              and item.path.name == "test_live_sglang_runs.py"]
    if SKIP_REASON is not None or not wanted:
        yield None
        return
    from train_runs import TrainRuns

    request.getfixturevalue("tiny_path")  # the warm-started tiny model the runs load, built once before they start
    runs = TrainRuns(tmp_path_factory.mktemp("sglang_runs"))
    try:
        yield runs
    finally:
        runs.close()


@pytest.fixture(scope="module", autouse=True)
def no_orphans(train_runs):
    yield
    if SKIP_REASON is None:
        kill_children(train_runs)
