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
