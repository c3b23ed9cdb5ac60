"""Report readability: rollout tick labels that do not run together, a moving average on short runs, and
`--group` drawing the seeds of one method as mean ± sd."""

import json
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from lit_rlvr.run import report

matplotlib.use("Agg")


def _write_run(path: Path, algorithm: str, rewards: list[float], per_step: int = 15000) -> Path:
    path.mkdir(parents=True)
    lines = ["epoch,step,reward/mean,reward/accuracy,rollouts/total,rollouts/per_step"]
    lines += [f"0,{s},{r},{(r + 1) / 2},{(s + 1) * per_step},{per_step}" for s, r in enumerate(rewards)]
    (path / "metrics.csv").write_text("\n".join(lines) + "\n")
    summary = {"algorithm": algorithm, "accuracy_before": 0.2, "accuracy_after": 0.4}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _figure(runs, monkeypatch, tmp_path):
    """The figure `report.plot` draws, caught before it is closed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    caught = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: caught.setdefault("fig", fig))
    report.plot(runs, tmp_path / "r.png")
    fig = caught["fig"]
    FigureCanvasAgg(fig).draw()  # plt.close left it without a renderer
    return fig


def test_rollout_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    run = report.load_run(_write_run(tmp_path / "a", "grpo", [0.1 * (s % 7) for s in range(12)]))
    fig = _figure([run], monkeypatch, tmp_path)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        boxes = [b for b in boxes if ax.bbox.x0 - 5 <= b.x0 and b.x1 <= ax.bbox.x1 + 5]
        for left, right in zip(boxes, boxes[1:]):
            assert left.x1 < right.x0, [t.get_text() for t in ax.get_xticklabels()]


def test_short_runs_get_a_moving_average():
    values = pd.Series([0.0, 1.0] * 5)
    assert not report.smooth(values).equals(values)
    assert report.smooth(values).iloc[-1] == pytest.approx(2 / 3)


def test_group_draws_mean_and_band(tmp_path, monkeypatch):
    runs = [report.load_run(_write_run(tmp_path / f"g{s}", "grpo", [s * 0.1, s * 0.1 + 0.2, s * 0.1 + 0.4]))
            for s in range(3)]
    runs.append(report.load_run(_write_run(tmp_path / "c0", "c3po", [0.0, 0.1, 0.2])))
    grouped = report.group_runs(runs)
    assert [r.label for r in grouped] == ["grpo · mean ± sd of 3 runs", f"c3po · {(tmp_path / 'c0').name}"]
    assert grouped[0].train["reward/mean"].tolist() == pytest.approx([0.1, 0.3, 0.5])
    assert grouped[0].train["reward/mean_sd"].tolist() == pytest.approx([0.1, 0.1, 0.1])
    fig = _figure(grouped, monkeypatch, tmp_path)
    assert any(ax.collections for ax in fig.axes)  # fill_between bands


def test_group_flag(tmp_path):
    runs = [report.load_run(_write_run(tmp_path / f"g{s}", "grpo", [s * 0.1, 0.5])) for s in range(2)]
    report.main([str(r.path) for r in runs] + ["--group", "--out", str(tmp_path / "g.png")])
    assert (tmp_path / "g.png").exists() and "mean ± sd of 2 runs" in (tmp_path / "g.md").read_text()
