"""Peak memory while saving a checkpoint: Lightning's default save (`TorchCheckpointIO`: the whole checkpoint
pickled into memory, then written via $TMPDIR) against `AtomicCheckpointIO` (streamed into the target dir).
Each save runs in a fresh process holding a `--mb` MB checkpoint; the rise is peak RSS (VmHWM) minus RSS before.

    python bench/checkpoint_memory.py --json [--mb 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = """
import sys, torch
from pathlib import Path
def kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lit_rlvr.run.checkpoint_io import AtomicCheckpointIO
mode, mb, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
state = {"state_dict": {"w": torch.ones(mb << 18)}}  # mb MB of float32
io = TorchCheckpointIO() if mode == "lightning" else AtomicCheckpointIO()
before = kb("VmRSS:")  # after the imports: only the save is measured
io.save_checkpoint(state, out / "last.ckpt")
print((kb("VmHWM:") - before) / 1024)
"""


def rise_mb(mode: str, mb: int) -> float:
    with tempfile.TemporaryDirectory(dir=".") as out:  # the target dir sits on the repo's disk
        result = subprocess.run([sys.executable, "-c", CHILD, mode, str(mb), out], capture_output=True, text=True,
                                check=True)
    return float(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"checkpoint_mb": args.mb, "lightning_rss_rise_mb": round(rise_mb("lightning", args.mb), 1),
              "atomic_rss_rise_mb": round(rise_mb("atomic", args.mb), 1)}
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
