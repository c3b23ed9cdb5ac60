"""`lit_rlvr.run.processes`: a process's peak memory is its own, whoever started it."""

from __future__ import annotations

import subprocess
import sys

from lit_rlvr.run.processes import peak_rss_mb


def test_a_small_process_started_by_a_large_one_reports_its_own_peak():
    """Linux keeps the high-water mark across exec, so `ru_maxrss` of a child started from a process holding
    200 MB reads at least 200 MB; `peak_rss_mb` reads what the child itself held."""
    held = bytearray(200 * 2**20)
    held[:: 4096] = b"x" * len(held[:: 4096])  # resident, not just reserved
    program = "from lit_rlvr.run.processes import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                                 check=True).stdout)
    assert 0 < child < 100 < 200 <= peak_rss_mb()
    del held
