"""Run plots from a metrics JSONL file."""

import json

import pytest

from hybridjax.metrics.plots import plot_run, read_metrics, series, write_plots


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_four_figures_from_a_run(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    labels, savefig = {}, matplotlib.figure.Figure.savefig

    def recording_savefig(fig, path, **kwargs):
        ax = fig.axes[0]
        labels[ax.get_title()] = ax.get_legend_handles_labels()[1]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    records = [{"step": 0, "val-core/arithmetic/acc/mean@1": 0.3}]
    for s in range(1, 5):
        records.append(
            {
                "step": s,
                "critic/score/mean": 0.1 * s,
                "response_length/mean": 5.0,
                "response_length/max": 7,
                "response_length/min": 4,
                "timing_s/gen": 1.0,
                "timing_s/update_actor": 2.0,
                "timing_s/offload": 0.1,
                "timing_s/step": 3.5,
            }
        )
    records[-1]["val-core/arithmetic/acc/mean@1"] = 0.6
    records[-1]["val-core/arithmetic/acc/best@4/mean"] = 0.8
    records[-1]["val-core/arithmetic/acc/best@4/std"] = 0.3
    records[-1]["val-core/arithmetic/acc/maj@4/mean"] = 0.7
    _write(tmp_path / "metrics.jsonl", records)
    written = write_plots(str(tmp_path))
    assert labels["Validation accuracy"] == [  # with N > 1: best@N and maj@N, no bootstrap std
        "arithmetic/acc/best@4",
        "arithmetic/acc/maj@4",
        "arithmetic/acc/mean@1",
    ]
    assert sorted(written) == ["response_length", "reward", "timing", "val_accuracy"]
    for path in written.values():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"written to {tmp_path}" in capsys.readouterr().out


def test_missing_metrics_are_skipped_and_nan_dropped(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "critic/score/mean": "nan"}])
    assert plot_run(str(tmp_path)) == {}
    assert write_plots(str(tmp_path / "nowhere")) == {}
    with pytest.raises(FileNotFoundError):
        plot_run(str(tmp_path / "nowhere"))


def test_resumed_steps_replace_earlier_records(tmp_path):
    _write(
        tmp_path / "m.jsonl",
        [{"step": 2, "a": 1.0}, {"step": 1, "a": 5.0}, {"step": 2, "a": 3.0, "b": 1.0}],
    )
    records = read_metrics(str(tmp_path / "m.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    assert series(records, "a") == ([1, 2], [5.0, 3.0])
    assert series(records, "b") == ([2], [1.0])
