"""Resume and checkpoint checks (issue 19, points 8-9): a resume whose config changes what the run computes is
refused before any work, listing each key; `resume_allow` accepts a change deliberately and it takes effect;
corrupt or foreign checkpoints give one line naming the file and `resume=`/`checkpoint=`; a refused resume
leaves metrics.csv where it was."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from lit_rlvr.config.errors import CheckpointError
from lit_rlvr.run.resume import check_config, check_weights_fit, config_differences, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
SMALL = ["eval_before=false", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "checkpoint_every=1"]


def train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *SMALL, f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def report(**record) -> None:
    if os.environ.get("FAULT_REPORT"):
        with open(os.environ["FAULT_REPORT"], "a") as handle:
            handle.write(json.dumps(record) + "\n")


# -- unit --------------------------------------------------------------------------------------------------
def test_config_differences_list_frozen_keys_and_pass_mutable_ones():
    saved = {"seed": 0, "algorithm": {"name": "grpo", "lr": 3e-4, "eval_samples": 4}, "data": {"batch_size": 4},
             "trainer": {"max_steps": 3, "precision": "32-true"}, "logger": {"csv": {}}}
    new = {"seed": 1, "algorithm": {"name": "c3po", "lr": 3e-4, "eval_samples": 8, "momentum": 0.9},
           "data": {"batch_size": 4}, "trainer": {"max_steps": 9, "precision": "32-true"}, "logger": {}}
    assert config_differences(saved, new) == [("algorithm.momentum", "<absent>", 0.9),
                                              ("algorithm.name", "grpo", "c3po"), ("seed", 0, 1)]


def test_model_compile_may_change_and_older_checkpoints_lack_it():
    """Compiling the update changes float order only (as micro_batch_size): a run resumes with it on or off, and a
    checkpoint written before the key existed reads as model.compile=false."""
    older = {"model": {"name_or_path": "tiny", "dtype": "float32"}}
    assert config_differences(older, {"model": {**older["model"], "compile": False}}) == []
    assert config_differences({"model": {**older["model"], "compile": True}},
                              {"model": {**older["model"], "compile": False}}) == []


NEW_ALGORITHM_KEYS = ("policy_loss", "advantages", "filter_groups", "overlong_cache_len", "overlong_penalty_factor")


@pytest.mark.parametrize("algorithm, old_keys", [
    ("grpo", {}),
    ("dapo", {"_target_": "lit_rlvr.algorithms.DAPOModule", "dynamic_sampling": True, "max_refill_batches": 3,
              "overlong_cache_len": 3, "overlong_penalty_factor": 1.0}),
    ("dr_grpo", {"_target_": "lit_rlvr.algorithms.DrGRPOModule"}),
    ("gspo", {"_target_": "lit_rlvr.algorithms.GSPOModule"}),
])
def test_checkpoints_written_before_the_variants_became_options_resume(algorithm, old_keys):
    """A config recorded when DAPO, Dr. GRPO and GSPO were subclasses (and before policy_loss, advantages,
    filter_groups and the overlong keys existed on GRPO) means today's config of the same algorithm."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lit_rlvr.run.resume import resolved_config

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        current = resolved_config(compose("config", overrides=[f"algorithm={algorithm}"]))
    old = OmegaConf.to_container(OmegaConf.create(current))
    old["algorithm"] = {k: v for k, v in old["algorithm"].items() if k not in NEW_ALGORITHM_KEYS} | old_keys
    assert config_differences(old, current) == []
    if algorithm == "dapo":  # the translation is exact, not a blanket pass; the cap only stops a run: it may change
        old["algorithm"]["max_refill_batches"] = 2
        assert config_differences(old, current) == []
        old["algorithm"]["dynamic_sampling"] = False
        assert config_differences(old, current) == [("algorithm.filter_groups.enable", False, True)]


def test_engine_placement_may_change_but_its_sampling_may_not():
    """A resumed job lands on other ports and memory budgets; the engine's dtype or seed changes what it samples."""
    saved = {"engine": {"name": "sglang", "options": {"base_port": 31300, "mem_fraction_static": 0.2, "seed": 0,
                                                      "dtype": None, "server_args": {"max_total_tokens": 65536}}}}
    new = {"engine": {"name": "sglang", "options": {"base_port": 31400, "mem_fraction_static": 0.5, "seed": 1,
                                                    "dtype": "bfloat16", "server_args": {"max_total_tokens": 4096}}}}
    assert config_differences(saved, new) == [("engine.options.dtype", None, "bfloat16"),
                                              ("engine.options.seed", 0, 1)]


def test_check_config_refuses_naming_each_key_and_allows_named_ones(tmp_path):
    state = {"global_step": 3, "lit_rlvr_config": {"config": {"seed": 0, "algorithm": {"lr": 3e-4}}}}
    new = {"seed": 0, "algorithm": {"lr": 0.1}}
    with pytest.raises(CheckpointError,
                       match=r"algorithm\.lr: checkpoint 0\.0003, now 0\.1.*resume_allow=\[algorithm\.lr\]"):
        check_config(tmp_path / "last.ckpt", state, new, allow=[])
    assert check_config(tmp_path / "last.ckpt", state, new, allow=["algorithm.lr"]) == [
        {"key": "algorithm.lr", "checkpoint": 3e-4, "new": 0.1, "step": 3}]


def _bad_files(tmp_path: Path, good: Path) -> dict[str, Path]:
    data = good.read_bytes()
    files = {"empty": b"", "truncated": data[: len(data) // 2], "garbage": os.urandom(4096)}
    paths = {}
    for name, content in files.items():
        paths[name] = tmp_path / f"{name}.ckpt"
        paths[name].write_bytes(content)
    paths["foreign zip"] = tmp_path / "foreign.ckpt"
    with zipfile.ZipFile(paths["foreign zip"], "w") as archive:
        archive.writestr("hello.txt", "not a checkpoint")
    paths["not a lit-rlvr dict"] = tmp_path / "tensor.ckpt"
    torch.save(torch.zeros(3), paths["not a lit-rlvr dict"])
    return paths


def test_corrupt_checkpoints_give_one_line_naming_file_and_key(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"policy.w": torch.zeros(2, 2)}, "global_step": 1}, good)
    assert load_checkpoint(good)["global_step"] == 1
    for name, path in _bad_files(tmp_path, good).items():
        for key in ("resume", "checkpoint"):
            with pytest.raises(CheckpointError) as err:
                load_checkpoint(path, key)
            message = str(err.value)
            assert "\n" not in message and f"{key}={str(path)!r}" in message, (name, message)
    report(fault="corrupt checkpoint (5 kinds)", bad_inputs=5, survived=False, stopped_cleanly=True, data_lost=0)


def test_weights_of_another_model_size_are_refused_naming_the_tensor(tmp_path):
    class Module(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.policy = nn.Linear(width, width)

    state = {"state_dict": Module(4).state_dict(), "global_step": 1}
    check_weights_fit(tmp_path / "a.ckpt", state, Module(4), "resume", "tiny")
    with pytest.raises(CheckpointError, match=r"resume=.*a\.ckpt.*do not fit model='tiny'.*"
                                              r"policy\.weight is \[4, 4\] there and \[8, 8\] here"):
        check_weights_fit(tmp_path / "a.ckpt", state, Module(8), "resume", "tiny")
    report(fault="checkpoint of another model size", bad_inputs=1, survived=False, stopped_cleanly=True, data_lost=0)


# -- end to end: python train.py ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A 1-step run; each test resumes from a copy of its run dir."""
    run_dir = tmp_path_factory.mktemp("resume_checks") / "first"
    rc, out = finish(train(run_dir, "trainer.max_steps=1"))
    assert rc == 0, out[-3000:]
    return run_dir


def _copy(first_run: Path, tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / name
    shutil.copytree(first_run, run_dir)
    return run_dir


REFUSED = {  # override -> the key the refusal must list
    "algorithm.lr=0.1": "algorithm.lr: checkpoint 0.0003, now 0.1",
    "seed=1": "seed: checkpoint 0, now 1",
    "data.batch_size=2": "data.batch_size: checkpoint 4, now 2",
    "algorithm=c3po": "algorithm.name: checkpoint 'grpo', now 'c3po'",
    "algorithm=v05": "algorithm.name: checkpoint 'grpo', now 'v05'",
}


def test_resume_with_a_changed_meaning_is_refused_before_any_work(first_run, tmp_path):
    procs = {}
    for override in REFUSED:
        run_dir = _copy(first_run, tmp_path, override.replace("=", "_"))
        procs[override] = (run_dir, train(run_dir, "trainer.max_steps=2", override,
                                          f"resume={run_dir}/checkpoints/last.ckpt"))
    for override, (run_dir, proc) in procs.items():
        rc, out = finish(proc)
        assert rc == 2 and REFUSED[override] in out, (override, out[-3000:])  # one line (lit_rlvr/run/one_line.py)
        assert "Traceback" not in out and "resume_allow=[" in out
        assert (run_dir / "metrics.csv").exists() and not (run_dir / "metrics.before_resume.csv").exists()
        assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1
    report(fault="resume with a changed config", bad_inputs=len(REFUSED), survived=False, stopped_cleanly=True,
           data_lost=0)


def test_corrupt_resume_checkpoint_fails_in_one_line_and_keeps_metrics(first_run, tmp_path):
    run_dir = _copy(first_run, tmp_path, "corrupt")
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    rc, out = finish(train(run_dir, "trainer.max_steps=2", f"resume={last}"))
    assert rc != 0 and f"resume={str(last)!r}: not a readable checkpoint" in out, out[-3000:]
    assert (run_dir / "metrics.csv").exists() and not (run_dir / "metrics.before_resume.csv").exists()


def test_resume_allow_applies_a_new_lr_and_records_it(first_run, tmp_path):
    run_dir = _copy(first_run, tmp_path, "allowed")
    rc, out = finish(train(run_dir, "trainer.max_steps=2", "algorithm.lr=0.1", "resume_allow=[algorithm.lr]",
                           f"resume={run_dir}/checkpoints/last.ckpt"))
    assert rc == 0, out[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2
    assert [g["lr"] for g in state["optimizer_states"][0]["param_groups"]] == [0.1] * len(
        state["optimizer_states"][0]["param_groups"])
    recorded = state["lit_rlvr_config"]
    assert recorded["config"]["algorithm"]["lr"] == 0.1
    assert recorded["overrides"] == [{"key": "algorithm.lr", "checkpoint": 0.0003, "new": 0.1, "step": 1}]


# -- issue 34, class 5: a refusal's hint, followed exactly, never crashes ---------------------------------------
def test_optimizer_change_is_read_from_the_record_or_the_config():
    from lit_rlvr.run.resume import optimizer_change

    adamw, ivon = type("AdamW", (), {})(), type("IVON", (), {})()  # only the class name and the groups matter
    adamw.param_groups = ivon.param_groups = [{"params": [0, 1]}]
    state = [{"param_groups": [{"params": [0, 1]}]}]

    def ckpt(record):
        return {"optimizer_states": state, "lit_rlvr_config": record}

    assert optimizer_change(ckpt({"optimizers": ["AdamW"]}), [adamw]) is None
    assert "IVON, this run's is AdamW" in optimizer_change(ckpt({"optimizers": ["IVON"]}), [adamw])
    assert "AdamW, this run's is IVON" in optimizer_change(ckpt({"optimizers": ["AdamW"]}), [ivon])
    # a checkpoint from before the record: its config's algorithm.optimizer (absent = adamw)
    assert optimizer_change(ckpt({"config": {"algorithm": {}}}), [adamw]) is None
    assert "ivon (algorithm.optimizer)" in optimizer_change(ckpt({"config": {"algorithm": {"optimizer": "ivon"}}}),
                                                            [adamw])
    assert "adamw (algorithm.optimizer)" in optimizer_change(ckpt({"config": {"algorithm": {}}}), [ivon])
    other = {"optimizer_states": [{"param_groups": [{"params": [0]}, {"params": [1]}]}],
             "lit_rlvr_config": {"optimizers": ["AdamW"]}}
    assert "other parameter groups" in optimizer_change(other, [adamw])


SWITCHES = {"c3po -> grpo": ("algorithm=c3po", "algorithm=grpo", "betas"),  # issue 34: KeyError 'betas' before
            "grpo -> c3po": ("algorithm=grpo", "algorithm=c3po", "ess")}


def test_following_the_hint_of_a_refused_algorithm_switch_exactly_resumes(first_run, tmp_path):
    """The refusal lists every changed key in its resume_allow=[...] hint (19 for c3po -> grpo, the optimizer
    among them); passing exactly that list resumes with fresh optimizer state, said in a warning."""
    sources = {"algorithm=grpo": first_run}
    c3po = tmp_path / "c3po_first"
    rc, out = finish(train(c3po, "trainer.max_steps=1", "algorithm=c3po"))
    assert rc == 0, out[-3000:]
    sources["algorithm=c3po"] = c3po
    refused = {}
    for name, (source, target, _) in SWITCHES.items():
        run_dir = _copy(sources[source], tmp_path, name.replace(" -> ", "_to_"))
        refused[name] = (run_dir, train(run_dir, "trainer.max_steps=2", target,
                                        f"resume={run_dir}/checkpoints/last.ckpt"))
    hinted = {}
    for name, (run_dir, proc) in refused.items():
        rc, out = finish(proc)
        allow = re.search(r"resume_allow=\[([^\]]*)\]", out)
        assert rc == 2 and allow and "algorithm.optimizer" in allow.group(1), out[-3000:]
        hinted[name] = train(run_dir, "trainer.max_steps=2", SWITCHES[name][1],
                             f"resume={run_dir}/checkpoints/last.ckpt", f"resume_allow=[{allow.group(1)}]")
    for name, proc in hinted.items():
        rc, out = finish(proc)
        assert rc == 0 and "Traceback" not in out, (name, out[-3000:])
        assert "fresh optimizer state" in out, out[-3000:]
        state = torch.load(refused[name][0] / "checkpoints" / "last.ckpt", weights_only=False)
        assert state["global_step"] == 2
        assert all(SWITCHES[name][2] in g for g in state["optimizer_states"][0]["param_groups"])  # the new one's
    report(fault="resume hint followed (optimizer switch)", bad_inputs=len(SWITCHES), survived=True, data_lost=0)
