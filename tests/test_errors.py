"""Which errors reach the user as one line (lit_rlvr/run/one_line.py), and which keep their traceback."""

import errno

import pytest

from lit_rlvr.config.errors import ConfigError, StorageError
from lit_rlvr.run.one_line import config_phase, one_line, one_line_errors, rename_keys


def _raised(make):
    try:
        make()
    except BaseException as err:  # noqa: BLE001  (the test inspects what came out)
        return err
    raise AssertionError("nothing raised")


def test_a_value_error_is_a_config_error_only_while_the_run_is_built():
    def build():
        with config_phase():
            raise ValueError("engine.mode='bad' is not valid")

    assert one_line(_raised(build)) == ("config error", ["engine.mode='bad' is not valid"])
    assert one_line(ValueError("a bug deep in a library")) is None  # during training: keeps its traceback
    assert one_line(ConfigError(["a", "b"])) == ("config error", ["a", "b"])


def test_the_first_storage_failure_of_a_chain_is_the_line():
    def cascade():
        try:
            raise StorageError("cannot write the checkpoint X: No space left on device", "X", errno.ENOSPC)
        except StorageError:
            raise StorageError("cannot write the metrics file Y: No space left on device", "Y", errno.ENOSPC)

    assert one_line(_raised(cascade)) == ("error", ["cannot write the checkpoint X: No space left on device"])
    library = OSError(errno.EROFS, "Read-only file system", "/runs/a/config.yaml")  # a library's own write
    assert one_line(library) == ("error", ["Read-only file system: /runs/a/config.yaml"])
    assert one_line(OSError(errno.ECONNRESET, "reset")) is None


def test_one_line_errors_prints_the_line_and_the_hint_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("LIT_RLVR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        with one_line_errors(key_prefixes={"algorithm.": "model.init_args."}):
            raise ConfigError(["algorithm.lr=-1.0 is not valid: expected a number > 0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: model.init_args.lr=-1.0 is not valid: expected a number > 0",
        "(set LIT_RLVR_DEBUG=1 for the traceback)"]
    monkeypatch.setenv("LIT_RLVR_DEBUG", "1")
    with pytest.raises(ConfigError):  # the traceback, as asked
        with one_line_errors():
            raise ConfigError(["x"])


def test_key_prefixes_are_renamed_where_a_key_starts_only():
    prefixes = {"algorithm.": "model.init_args.", "model.options.": "model.init_args.model_options."}
    assert rename_keys("algorithm.group_size=0; model.options.target", prefixes) == \
        "model.init_args.group_size=0; model.init_args.model_options.target"
    assert rename_keys("my_algorithm.x and data.algorithm.y", prefixes) == "my_algorithm.x and data.algorithm.y"
