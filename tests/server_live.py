"""Shared by the live server-engine tests (tests/test_vllm_server_live.py,
tests/live_sglang/test_live_sglang_server.py): real servers started with `lit-rlvr-serve` on 127.0.0.1, and
`train.py` runs over them.

Each server is a process group of its own (the serve command becomes the server; vLLM's engine core and SGLang's
scheduler are its children), so stopping it ends them all, by the group this test started."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import requests

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 900  # a server's start on a loaded 2-core machine: imports, model load, warm-up
# tiny_cot runs kept short: 4 prompts x 4 samples a step, no evaluation
RUN = ["data=arithmetic_cot", "data.batch_size=4", "algorithm.group_size=4", "data.num_test=8", "eval_before=false",
       "callbacks.progress=null", "checkpoint_every=1"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`lit-rlvr-serve --engine ENGINE --model MODEL --port PORT` in the background, its output in `log`."""

    def __init__(self, engine: str, model: str, log: Path, extra: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        serve = Path(sys.executable).with_name("lit-rlvr-serve")
        with log.open("w") as out:
            self.proc = subprocess.Popen([str(serve), "--engine", engine, "--model", model, "--port", str(self.port),
                                          *extra], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        """Until GET /health answers 200; a server that exits first fails with its log's end."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.url} exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            time.sleep(2)
        raise TimeoutError(f"server {self.url} not ready after {timeout_s} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """End the server's process group (this test's own), and wait for it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_servers(engine: str, model: str, folder: Path, count: int, extra: Sequence[str] = ()) -> list[Server]:
    """`count` servers started together (their start-ups overlap), each ready, or all ended and the failure raised."""
    servers = [Server(engine, model, folder / f"server_{i}.log", extra) for i in range(count)]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


def train(run_dir: Path, overrides: Sequence[str], *, steps: int, background: bool = False):
    """`train.py` over server engines; returns (return code, output), or the `Popen` when `background`."""
    cmd = [sys.executable, "train.py", *RUN, *overrides, f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if background:
        return proc
    out, _ = proc.communicate(timeout=1800)
    return proc.returncode, out


def train_two_nodes(run_dir: Path, overrides: Sequence[str], *, steps: int) -> list[tuple[int, str]]:
    """`train.py` as two trainer nodes on this machine (two `torchrun --nnodes 2` launches, node ranks 0 and 1, a c10d
    rendezvous on 127.0.0.1, gloo, FSDP2), one rank each, over server engines, in one run dir; each launch's (return
    code, output)."""
    rendezvous = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "server_nodes"]
    cmd = [*RUN, *overrides, "trainer=fsdp", "trainer.accelerator=cpu", "trainer.strategy.param_dtype=float32",
           "trainer.num_nodes=2", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]

    def launch(node: int) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *rendezvous, "--node_rank", str(node),
                               "train.py", *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=1800)
        return done.returncode, done.stdout

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(launch, (0, 1)))


def rows(run_dir: Path) -> list[dict[str, float]]:
    """metrics.csv's training rows (those with a reward), as floats."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as handle:
        found = [r for r in csv.DictReader(handle) if r.get("reward/mean")]
    return [{k: float(v) for k, v in r.items() if v not in ("", "nan")} for r in found]


def wait_rows(run_dir: Path, count: int, proc: subprocess.Popen, timeout_s: float = 1200) -> None:
    """Until metrics.csv holds `count` training rows (the run logs each step's)."""
    end = time.monotonic() + timeout_s
    while len(rows(run_dir)) < count:
        if proc.poll() is not None:
            raise RuntimeError(f"train.py ended ({proc.returncode}) before step {count}:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > end:
            raise TimeoutError(f"train.py logged no step {count} in {timeout_s} s")
        time.sleep(1)


def urls(servers: Sequence[Server], extra: Optional[Sequence[str]] = ()) -> str:
    return f"engine.options.urls=[{','.join([*(s.url for s in servers), *(extra or ())])}]"


# -- runs both live server test files check, over their module's two servers ------------------------------------
def check_c3po(engine: str, servers: Sequence[Server], run: Path) -> None:
    """C3PO over both servers, 2 steps: each weight sample reaches the servers before its samples are drawn (the
    post-push check of every step's pushes stays within its bound) and the run finishes."""
    code, out = train(run, [f"engine={engine}_server", urls(servers), "algorithm=c3po"], steps=2)
    assert code == 0, out[-5000:]
    logged = rows(run)
    assert len(logged) == 2 and all(r["engine/servers_alive"] == 2 for r in logged)
    assert all(r["engine/sync_logp_diff"] <= 0.02 for r in logged)
    assert all(r["time/sync_s"] > 0 for r in logged)  # the N weight samples were pushed (a push per sample)


def check_lora(engine: str, servers: Sequence[Server], run: Path) -> None:
    """A LoRA policy with C3PO over both servers, 2 steps: every push (merged weights, each weight sample's too)
    reaches the servers, whose log-probs then match the trainer's."""
    code, out = train(run, [f"engine={engine}_server", urls(servers), "algorithm=c3po", "model.lora.rank=8"],
                      steps=2)
    assert code == 0, out[-5000:]
    logged = rows(run)
    assert len(logged) == 2 and all(r["engine/servers_alive"] == 2 for r in logged)
    assert all(r["engine/sync_logp_diff"] <= 0.02 for r in logged)
    assert (run / "checkpoints" / "adapter" / "adapter_model.safetensors").exists()


def check_async(engine: str, servers: Sequence[Server], run: Path) -> None:
    """`rollout.mode=async` with S = 1 over both servers, 3 steps: the next batch is drawn while the trainer updates
    (pushes land between generation calls, the servers paused around each), no batch is more than one update
    behind, and every checked push matched the trainer."""
    overrides = [f"engine={engine}_server", urls(servers), "rollout.mode=async", "rollout.max_staleness=1"]
    code, out = train(run, overrides, steps=3)
    assert code == 0, out[-5000:]
    logged = rows(run)
    assert len(logged) == 3 and all(r["engine/servers_alive"] == 2 for r in logged)
    staleness = [r["async/staleness_mean"] for r in logged]
    assert max(staleness) <= 1 and max(staleness) > 0, staleness  # a batch drawn on the weights one update behind
    assert all(r["engine/sync_logp_diff"] <= 0.02 for r in logged if "engine/sync_logp_diff" in r)


def check_two_nodes(engine: str, servers: Sequence[Server], run: Path) -> None:
    """Two trainer nodes (train_two_nodes) over both servers, 2 steps: rank 0 alone pushes, both ranks sample the
    pushed weights (the post-push check), the logged batch is the global one (4 prompts x 4 samples a step, 2
    prompts a rank) and one writer logs it."""
    done = train_two_nodes(run, [f"engine={engine}_server", urls(servers)], steps=2)
    for code, out in done:
        assert code == 0, out[-5000:]
    logged = rows(run)
    assert len(logged) == 2
    for step, row in enumerate(logged):
        assert row["rollouts/total"] == (step + 1) * 4 * 4
        assert row["engine/sync_logp_diff"] <= 0.02 and row["engine/servers_alive"] == 2
    assert (run / "checkpoints" / "last.ckpt").exists()
