"""The whole `python train.py engine=sglang_cpu` runs that tests/live_sglang/test_live_sglang_runs.py checks, started
in the background at the session's start (conftest.py) when a selected test needs them: each run is mostly
single-threaded start-up (imports, its own sglang engine), as are the engine tests of the other modules, so the
runs go on two at a time beside them instead of after them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from sglang_live import REPO

HERE = Path(__file__).resolve().parent
SMALL = ["engine=sglang_cpu", "data.num_test=4", "callbacks.progress=null", "data.batch_size=4",
         "algorithm.group_size=4", "+callbacks.push_probe._target_=push_probe.PushProbe"]
V05 = ["algorithm=v05", "algorithm.callbacks.value_prior.min_context=4", "algorithm.callbacks.value_prior.k_max=8"]
FSDP_CPU = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy.param_dtype=float32"]
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
RUNS = {  # name: (overrides, engine base port[, launcher]); distinct ports: engines of parallel runs share none
    # GRPO, and the first part of "resumed" (a checkpoint after every step)
    "grpo": (["algorithm=grpo", "trainer.max_steps=2", "checkpoint_every=1"], 31000),
    "c3po": (["algorithm=c3po", "trainer.max_steps=3"], 31100),
    "v05": ([*V05, "trainer.max_steps=2"], 31200),
    "c3po_lora": (["algorithm=c3po", "model.lora.rank=4", "trainer.max_steps=2"], 31600),
    # rollout.mode=async: the producer generates the next batch while the trainer updates; each push lands in the
    # batch being generated (partial rollouts), between two segments of 4 tokens
    "async": (["algorithm=grpo", "rollout.mode=async", "rollout.max_staleness=1", "trainer.max_steps=3",
               "eval_before=false", "rollout.partial_rollout=true", "rollout.kv_at_swap=recompute",
               "engine.options.sync_check_every=0", "engine.options.segment_tokens=4"], 31700),
    # torchrun, FSDP2 over gloo: each rank its own engine (ports spaced by local rank)
    "ranks2": (["algorithm=grpo", "trainer.max_steps=2", "eval_before=false", *FSDP_CPU], 31500, TORCHRUN),
}
RESUMED = (["algorithm=grpo", "trainer.max_steps=3"], 31400)  # + resume= grpo's last.ckpt
TIMEOUT_S = 1200


class TrainRuns:
    """The runs under `root`, two at a time in a thread pool; `result()` waits for them all."""

    def __init__(self, root: Path):
        self.dirs = {**{name: root / name for name in RUNS}, "resumed": root / "resumed"}
        self.procs: list[subprocess.Popen] = []
        self.starting = threading.Lock()  # held while a run starts (sglang_live.own_children)
        self._pool = ThreadPoolExecutor(max_workers=2)
        jobs = [self._grpo_then_resumed,  # the longest chain first; each slot takes the next job
                *[lambda name=name: self._run(self.dirs[name], *RUNS[name]) for name in RUNS if name != "grpo"]]
        self._futures: list[Future] = [self._pool.submit(job) for job in jobs]

    def _grpo_then_resumed(self) -> None:
        self._run(self.dirs["grpo"], *RUNS["grpo"])
        overrides, port = RESUMED
        self._run(self.dirs["resumed"], [*overrides, f"resume={self.dirs['grpo']}/checkpoints/last.ckpt"], port)

    def _run(self, run_dir: Path, overrides: list[str], port: int, launcher=(sys.executable,)) -> None:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "SGLANG_USE_CPU_ENGINE": "1"}
        log = run_dir.parent / f"{run_dir.name}.log"
        cmd = [*launcher, "train.py", *SMALL, *overrides, f"engine.options.base_port={port}",
               f"+callbacks.push_probe.out_dir={run_dir}", f"hydra.run.dir={run_dir}"]
        with self.starting:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its whole group (engines included) can be killed
            self.procs.append(proc)
        try:
            proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, log.read_text()[-4000:]

    def result(self) -> dict[str, Path]:
        """The run directories, once every run has ended; a failed run's assertion otherwise."""
        for future in self._futures:
            future.result()
        return self.dirs

    def close(self) -> None:
        """Wait for the runs (each ends, or is killed at its timeout)."""
        self._pool.shutdown(wait=True)
