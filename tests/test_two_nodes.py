"""Several trainer nodes: `trainer.num_nodes=2` as two torchrun launches on one machine, and the SLURM script.

Two nodes: two `torchrun --nnodes 2 --nproc_per_node 1` launches (node ranks 0 and 1) meet at a c10d rendezvous on
127.0.0.1 and train over gloo with FSDP2 and one colocated `copy`-mode HF engine per rank, in one run dir (the
same `hydra.run.dir`, as a shared filesystem gives on real nodes). The reference is the 2-rank one-node run
(`torchrun --nproc_per_node 2`). The two have the same ranks, the same global batch and the same sampling
seeds; only which process becomes rank 0 may differ (c10d orders the nodes by arrival), so their loss, reward and
final weights agree to float rounding (compared at 1e-5 relative, not bitwise).

SLURM: `scripts/slurm_train.sh --dry-run` under fake SLURM variables prints what it would launch.
"""

from __future__ import annotations

import csv
import os
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
STEPS = 2
COMMON = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.strategy.param_dtype=float32",
          "engine.options.mode=copy", "data.batch_size=8", "data.num_test=16", "algorithm.group_size=4",
          "eval_before=false", "callbacks.progress=null", f"trainer.max_steps={STEPS}"]
COMPARED = ("loss/", "reward/")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _launch(launcher: list[str], overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "train.py", *COMMON, *overrides,
           f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory):
    """The two node launches and the one-node reference, side by side (4 processes)."""
    base = tmp_path_factory.mktemp("nodes")
    rendezvous = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"127.0.0.1:{_free_port()}", "--rdzv_id", "two_nodes"]
    with ThreadPoolExecutor(3) as pool:
        nodes = [pool.submit(_launch, [*rendezvous, "--node_rank", str(rank)], ["trainer.num_nodes=2"],
                             base / "two_nodes") for rank in (0, 1)]
        one_node = pool.submit(_launch, ["--standalone", "--nproc_per_node", "2"],
                               ["trainer.num_nodes=1", "trainer.devices=2"], base / "one_node")
    for done in [*(n.result() for n in nodes), one_node.result()]:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return base / "two_nodes", base / "one_node"


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as handle:
        return [r for r in csv.DictReader(handle) if r.get("reward/mean")]


def test_two_nodes_train_as_two_ranks_on_one_node(runs):
    two_nodes, one_node = runs
    rows_two, rows_one = _rows(two_nodes), _rows(one_node)
    assert len(rows_two) == len(rows_one) == STEPS  # one writer: rank 1 added no rows of its own
    for step, (a, b) in enumerate(zip(rows_two, rows_one)):
        keys = [k for k in b if k.startswith(COMPARED) and b[k] not in ("", "nan")]
        assert "loss/policy" in keys and "reward/mean" in keys
        for key in keys:
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), (step, key)
        assert float(a["rollouts/total"]) == float(b["rollouts/total"]) == (step + 1) * 8 * 4  # the global batch


def test_two_nodes_end_with_the_same_weights(runs, tiny_path):
    two_nodes, one_node = (torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
                           for run in runs)
    assert two_nodes["global_step"] == one_node["global_step"] == STEPS
    assert two_nodes["state_dict"].keys() == one_node["state_dict"].keys()
    for name, weight in one_node["state_dict"].items():
        torch.testing.assert_close(two_nodes["state_dict"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    # and both runs trained: their weights moved from the warmed-up model they started from
    start = load_file(str(Path(tiny_path) / "model.safetensors"))
    moved = [name for name, weight in start.items()
             if not torch.allclose(one_node["state_dict"][f"policy.{name}"], weight, rtol=1e-5, atol=1e-6)]
    assert moved, "no weight changed in training"


def test_two_nodes_write_their_outputs_once(runs):
    two_nodes, one_node = runs
    files = {run: sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) for run in runs}
    assert files[two_nodes] == files[one_node]  # nothing per node or per rank beside the run's own files
    for name in ("completions.jsonl", "train.log"):
        lines = [len((run / name).read_text().splitlines()) for run in runs]
        assert lines[0] == lines[1], name


# ---- scripts/slurm_train.sh, as a dry run under fake SLURM variables ----------------------------------------

def _slurm(tmp_path: Path, nodelist: str, *train_args: str, scontrol: list[str] | None = None,
           flag: bool = True, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_NODELIST=nodelist, SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(REPO), **settings)
    if scontrol is not None:  # a stand-in scontrol on PATH: `scontrol show hostnames LIST` prints these hosts
        fake = tmp_path / "bin"
        fake.mkdir(exist_ok=True)
        (fake / "scontrol").write_text("#!/bin/sh\n" + "".join(f"echo {host}\n" for host in scontrol))
        (fake / "scontrol").chmod(0o755)
        env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    else:
        env["DRY_RUN"] = "1"
    args = ["--dry-run"] if flag else []
    return subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sh"), *args, *train_args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)


def _commands(done: subprocess.CompletedProcess) -> list[list[str]]:
    assert done.returncode == 0, done.stderr
    return [shlex.split(line) for line in done.stdout.splitlines()]


def test_slurm_script_serves_on_engine_nodes_and_trains_on_the_others(tmp_path):
    done = _slurm(tmp_path, "gpu[01-03]", "data=dapo_math", "algorithm=c3po", scontrol=["gpu01", "gpu02", "gpu03"],
                  MODEL="/shared/Qwen3-4B", TRAIN_NODES="2", GPUS_PER_NODE="8", SERVE_ARGS="--tensor-parallel-size 8")
    serve, train = _commands(done)
    assert serve == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu03", "lit-rlvr-serve", "--engine", "vllm",
                     "--model", "/shared/Qwen3-4B", "--host", "0.0.0.0", "--port", "8101",
                     "--tensor-parallel-size", "8"]
    run_dir = REPO / "runs" / "slurm-4242"
    assert train == ["srun", "--nodes=2", "--ntasks-per-node=8", "--nodelist=gpu01,gpu02", "python", "train.py",
                     "trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=8", "engine=vllm_server",
                     "engine.options.urls=[http://gpu03:8101]", f"engine.options.weight_dir={run_dir}/weights",
                     "model.name_or_path=/shared/Qwen3-4B", f"hydra.run.dir={run_dir}",
                     "data=dapo_math", "algorithm=c3po"]


def test_slurm_script_gives_every_engine_node_a_server_and_the_trainer_every_url(tmp_path):
    """A plain comma list (no scontrol needed), SGLang, a preset model, DRY_RUN=1 instead of the flag."""
    done = _slurm(tmp_path, "a,b,c,d", flag=False, MODEL="tiny_cot", ENGINE="sglang", TRAIN_NODES="2",
                  GPUS_PER_NODE="4", PORT="9000", RUN_DIR=str(tmp_path / "run"))
    *serves, train = _commands(done)
    assert [(s[3], s[s.index("--engine") + 1], s[s.index("--port") + 1]) for s in serves] == [
        ("--nodelist=c", "sglang", "9000"), ("--nodelist=d", "sglang", "9000")]
    assert train[:4] == ["srun", "--nodes=2", "--ntasks-per-node=4", "--nodelist=a,b"]
    assert {"trainer.num_nodes=2", "trainer.devices=4", "engine=sglang_server", "model=tiny_cot",
            "engine.options.urls=[http://c:9000,http://d:9000]", f"hydra.run.dir={tmp_path / 'run'}"} <= set(train)
    assert not (tmp_path / "run").exists()  # a dry run creates nothing


@pytest.mark.parametrize("nodelist, settings, message", [
    ("a", {"MODEL": "m"}, "has 1 node(s)"),
    ("a,b", {"MODEL": "m", "TRAIN_NODES": "2"}, "TRAIN_NODES=2: allowed: 1-1"),
    ("a,b", {}, "MODEL is not set"),
    ("a,b", {"MODEL": "m", "ENGINE": "hf"}, "ENGINE=hf: allowed: vllm, sglang"),
    ("a,b", {"MODEL": "m", "GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0"),
])
def test_slurm_script_refuses_a_bad_layout_in_one_line(tmp_path, nodelist, settings, message):
    done = _slurm(tmp_path, nodelist, **settings)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr
