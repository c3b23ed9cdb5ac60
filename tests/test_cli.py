"""`lit-rlvr fit|validate --config conf/cli/tiny_grpo.yaml`: trains the tiny default, resumes, validates."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_faults import report

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "cli" / "tiny_grpo.yaml"


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def column(path: Path, name: str) -> list[float]:
    return [float(r[name]) for r in rows(path) if r.get(name)]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """`lit-rlvr fit` as a user runs it: the console script in a subprocess, 2 steps."""
    run = tmp_path_factory.mktemp("cli") / "run"
    exe = shutil.which("lit-rlvr")
    command = [exe] if exe else [sys.executable, "-m", "lit_rlvr.app.cli"]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    done = subprocess.run([*command, "fit", "--config", str(CONFIG), "--trainer.max_steps", "2",
                           "--trainer.logger.init_args.save_dir", str(run)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run


def test_fit_writes_metrics_config_and_checkpoint(fitted):
    metrics = fitted / "metrics.csv"
    assert column(metrics, "step") == [0, 1]
    assert len(column(metrics, "reward/mean")) == 2 and len(column(metrics, "grad/norm")) == 2
    assert column(metrics, "rollouts/total") == [64, 128]  # 8 prompts x 8 samples per step
    assert (fitted / "checkpoints" / "last.ckpt").exists()
    assert "class_path: lit_rlvr.module.GRPOModule" in (fitted / "config.yaml").read_text()


def test_fit_resumes_from_ckpt_path(fitted, tmp_path):
    from lit_rlvr.app.cli import main

    main(["fit", "--config", str(CONFIG), "--trainer.max_steps", "3", "--trainer.logger.init_args.save_dir",
          str(tmp_path), "--ckpt_path", str(fitted / "checkpoints" / "last.ckpt")])
    metrics = tmp_path / "metrics.csv"
    assert column(metrics, "step") == [2]  # continues at step 2, not from 0
    assert column(metrics, "rollouts/total") == [192]  # counters restored from the checkpoint


def test_validate_with_ckpt_path(fitted, tmp_path):
    from lit_rlvr.app.cli import main

    main(["validate", "--config", str(CONFIG), "--ckpt_path", str(fitted / "checkpoints" / "last.ckpt"),
          "--trainer.logger.init_args.save_dir", str(tmp_path)])
    accuracy = column(tmp_path / "metrics.csv", "val/accuracy")
    assert len(accuracy) == 1 and 0.0 <= accuracy[0] <= 1.0



def test_group_of_one_is_refused_before_training(tmp_path):
    """The Lightning CLI skips the Hydra recipe's config checks: the module refuses G = 1 itself, naming the key."""
    exe = shutil.which("lit-rlvr")
    command = [exe] if exe else [sys.executable, "-m", "lit_rlvr.app.cli"]
    env = {**os.environ, "LIT_RLVR_CACHE": os.environ.get("LIT_RLVR_CACHE", "~/.cache/lit_rlvr")}
    done = subprocess.run([*command, "fit", "--config", str(CONFIG), "--trainer.max_steps", "1",
                           "--model.init_args.algorithm.group_size", "1",
                           "--trainer.logger.init_args.save_dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "model.init_args.algorithm.group_size" in done.stderr, done.stderr[-3000:]


# -- issue 34, class 7: a constructor's or a check's config error is one line from every entry ---------------
BAD_CLI = {  # argument -> what the line must say; raised by a constructor, at fit start, or by the optimizer
    "--model.init_args.algorithm.group_size=0": "model.init_args.algorithm.group_size=0 is not valid: expected an "
                                                "integer in [1, 65536]",
    "--model.init_args.algorithm.group_size=1": "model.init_args.algorithm.group_size=1 is not valid: expected an "
                                                "integer >= 2",
    "--model.init_args.algorithm.lr=-1": "model.init_args.algorithm.lr=-1.0 is not valid: expected a number > 0",
    "--model.init_args.algorithm.betas=[2.0, 0.999]": "model.init_args.algorithm.betas=(2.0, 0.999) is not valid",
    "--data.batch_size=0": "data.batch_size=0 is not valid: expected an integer >= 1 (prompts per RL step, all "
                           "ranks together)",
    "--model.init_args.engine.options={mode: bad}": "model.init_args.engine.options.mode='bad' is not valid",
}


def _cli(*args: str) -> subprocess.Popen:
    exe = shutil.which("lit-rlvr")
    command = [exe] if exe else [sys.executable, "-m", "lit_rlvr.app.cli"]
    return subprocess.Popen([*command, "fit", "--config", str(CONFIG), "--trainer.max_steps", "1", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_line(proc: subprocess.Popen) -> str:
    """The error line; the output holds no traceback and ends with the hint to LIT_RLVR_DEBUG."""
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 2 and "Traceback" not in out + err, (out + err)[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "(set LIT_RLVR_DEBUG=1 for the traceback)" and lines[-2].startswith("config error: "), lines
    return lines[-2]


def test_config_errors_are_one_line_from_the_cli_as_from_train_py(tmp_path):
    procs = {arg: _cli(arg, "--trainer.logger.init_args.save_dir", str(tmp_path / str(i)))
             for i, arg in enumerate(BAD_CLI)}
    train = subprocess.Popen([sys.executable, "train.py", "algorithm.group_size=0", f"hydra.run.dir={tmp_path}/t"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = {arg: _last_line(proc) for arg, proc in procs.items()}
    for arg, line in lines.items():
        assert BAD_CLI[arg] in line, (arg, line)
    from lit_rlvr.app.cli import cli_keys

    train_line = _last_line(train)  # the same check, the same words; each entry names its own key
    assert cli_keys(train_line) == lines["--model.init_args.algorithm.group_size=0"], (train_line, lines)
    from lit_rlvr.module import GRPOModule

    with pytest.raises(ValueError) as err:  # Python: the same line, as the exception's message
        GRPOModule(group_size=0)
    assert f"config error: {err.value}" == train_line
    report(fault="config errors, one line (CLI, train.py, Python)", bad_inputs=len(BAD_CLI) + 2, survived=False,
           stopped_cleanly=True, data_lost=0)


# jsonargparse's reports (4.x) of a value it refuses, as the CLI printed them before they became one line
NESTED_TYPE = '''Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lit_rlvr.module.GRPOModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lit_rlvr.module.GRPOModule':
        Parser key "algorithm.lr":
          Expected a <class 'float'>. Got value: abc
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='algorithm.lr', val='abc')'''
NESTED_UNKNOWN = '''Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lit_rlvr.module.GRPOModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lit_rlvr.module.GRPOModule':
        unrecognized arguments: --algorithm.lrr=1
    - Expected a <class 'NoneType'>'''


@pytest.mark.parametrize("message, line", [
    (NESTED_TYPE, "model.init_args.algorithm.lr=abc is not valid: expected a number"),
    (NESTED_UNKNOWN, "model.init_args.algorithm.lrr is not an option"),
    ('Parser key "data.batch_size":\n  Expected a <class \'int\'>. Got value: abc',
     "data.batch_size=abc is not valid: expected an integer"),
    ("unrecognized arguments: --trainer.max_stepz=3", "trainer.max_stepz is not an option"),
])
def test_a_value_the_parser_refuses_is_one_line_naming_the_clis_key(message, line):
    from lit_rlvr.app.cli import cli_keys, parse_error_line

    assert cli_keys(parse_error_line(message)).startswith(line)
