"""scripts/plot_metrics.py: the series it draws (a resumed run's repeated steps, gaps), the legend names, the picture
itself from fabricated and real metrics files, and its one-line answer when matplotlib is missing."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess.launch import train_in_process

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "plot_metrics.py"
_spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
plot_metrics = importlib.util.module_from_spec(_spec)
sys.modules["plot_metrics"] = plot_metrics  # its dataclass looks its module up there
_spec.loader.exec_module(plot_metrics)


def write_metrics(path: Path, records: list[dict]) -> Path:
    """A metrics.jsonl from records; each gets the trainer's other keys where it lacks them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"grad_norm": 1.0 + r["step"] % 3, "lr": 1e-3, "tps": 1000.0 + r["step"], **r})
             for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def falling(n: int, start: float = 10.0, rate: float = 0.9) -> list[dict]:
    return [{"step": s, "loss": start * rate**s} for s in range(1, n + 1)]


def test_a_step_logged_again_after_a_resume_record_is_drawn_once_with_its_later_record(tmp_path):
    # Logged 1-4, crashed, resumed from the checkpoint of step 2: steps 3 and 4 logged again, with other values (a
    # file joined by hand: the trainer cuts the records past the checkpoint itself).
    first = [{"step": s, "loss": 10.0 - s, "lr": s / 1000} for s in range(1, 5)]
    resumed = [{"step": s, "loss": 20.0 - s, "lr": s / 500} for s in range(3, 6)]
    first[3]["val_loss"], resumed[1]["val_loss"] = 7.5, 6.5  # both at step 4
    path = write_metrics(tmp_path / "metrics.jsonl", first)
    with open(path, "a") as f:
        f.write(json.dumps({"event": "resume", "step": 2, "world_size": 1}) + "\n")
    path.write_text(path.read_text() + write_metrics(tmp_path / "resumed.jsonl", resumed).read_text())
    run = plot_metrics.load_run(path, "r")
    assert run.series["loss"] == ([1, 2, 3, 4, 5], [9.0, 8.0, 17.0, 16.0, 15.0])
    assert run.series["lr"] == ([1, 2, 3, 4, 5], [1 / 1000, 2 / 1000, 3 / 500, 4 / 500, 5 / 500])
    assert run.series["val_loss"] == ([4], [6.5])


def test_each_file_is_read_once(tmp_path, monkeypatch):
    path = write_metrics(tmp_path / "metrics.jsonl", falling(5))
    opened, real_open = [], open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(Path(f)) or real_open(f, *a, **k))
    run = plot_metrics.load_run(path, "r")
    assert opened == [path] and set(run.series) == {"loss", "lr", "grad_norm", "tps"}


def test_non_finite_values_are_gaps_and_absent_keys_have_no_series(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"step": 1, "loss": 3.0, "grad_norm": 1.0},
        {"step": 2, "loss": 2.5, "grad_norm": math.inf},  # a skipped fp16 step
        {"step": 3, "loss": 2.0, "grad_norm": 0.5},
    ]) + "\n")
    run = plot_metrics.load_run(path, "r")
    steps, norms = run.series["grad_norm"]
    assert steps == [1, 2, 3] and norms[0] == 1.0 and math.isnan(norms[1]) and norms[2] == 0.5
    assert set(run.series) == {"loss", "grad_norm"}  # no lr, tps or val_loss logged: nothing to draw


def test_legend_names_are_folder_names_made_unique(tmp_path):
    a = write_metrics(tmp_path / "a" / "run" / "metrics.jsonl", falling(2))
    b = write_metrics(tmp_path / "b" / "run" / "metrics.jsonl", falling(2))
    other = write_metrics(tmp_path / "c" / "lr_3e-3.jsonl", falling(2))
    assert plot_metrics.run_names([a.parent, b, other]) == ["a/run", "b/run", "lr_3e-3"]
    assert plot_metrics.run_names([a, a.parent]) == [str(a.parent), f"{a.parent} (2)"]


def test_png_of_fabricated_and_real_runs_shows_every_run(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import colors, image

    a = write_metrics(tmp_path / "a" / "metrics.jsonl", falling(30))
    b_steps = falling(20, 12.0, 0.8)
    b_steps[-1]["val_loss"] = 1.0  # validated at the last step: in that step's record, as the trainer logs it
    b = write_metrics(tmp_path / "b" / "metrics.jsonl", b_steps)
    real = tmp_path / "real"
    train_in_process(real, "--training.steps", "3", "--validation.enable", "--validation.freq", "2",
                     "--validation.steps", "1")
    out = tmp_path / "pics" / "curves.png"
    assert plot_metrics.main([str(a), str(b.parent), str(real), "--out", str(out)]) == 0
    pixels = image.imread(out)[..., :3]
    assert pixels.shape[:2] == (800, 1200)  # figsize 12x8 inches at matplotlib's default 100 dpi
    def painted(color):  # pixels of about this colour
        return (abs(pixels - colors.to_rgb(color)).max(axis=-1) < 0.05).sum()

    # Each run is drawn in its own colour, the default cycle's first three; the fourth is in no picture of three.
    assert all(painted(c) > 100 for c in ("tab:blue", "tab:orange", "tab:green"))
    assert painted("tab:red") == 0

    log = tmp_path / "log.png"
    assert plot_metrics.main([str(a), str(b.parent), str(real), "--out", str(log), "--log_loss"]) == 0
    assert image.imread(log).shape == image.imread(out).shape
    assert (image.imread(log) != image.imread(out)).any()


def test_without_matplotlib_one_line_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    a = write_metrics(tmp_path / "a.jsonl", falling(3))
    assert plot_metrics.main([str(a), "--out", str(tmp_path / "out.png")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install matplotlib" in err[0]
    assert not (tmp_path / "out.png").exists()


def test_bad_input_is_one_error_line_and_exit_2(tmp_path):
    pytest.importorskip("matplotlib")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 1, "mfu": 0.1}) + "\n")
    spliced = write_metrics(tmp_path / "spliced.jsonl", falling(3) + falling(2))  # a rerun appended to a run
    for run, expected in ((tmp_path / "nope", "no such file"), (empty, "no record has any of"),
                          (spliced, "spliced.jsonl:4: step 1 after step 3 with no resume record between")):
        r = subprocess.run([sys.executable, str(SCRIPT), str(run), "--out", str(tmp_path / "out.png")],
                           capture_output=True, text=True, check=False)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith("error: ") and expected in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "out.png").exists()


def test_a_mixture_gets_a_panel_per_source_with_its_validation_dashed(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib import colors, image

    records = [{**r, "loss/code": r["loss"] + 1, "loss/web": r["loss"] - 1, "tokens/code": 64 * r["step"]}
               for r in falling(12)]
    records[-1].update({"val_loss": 2.0, "val_loss/code": 2.5, "val_loss/web": 1.5})
    run = plot_metrics.load_run(write_metrics(tmp_path / "mix" / "metrics.jsonl", records), "mix")
    assert {"loss/code", "loss/web", "val_loss/code", "val_loss/web"} <= run.series.keys()
    assert run.series["loss/web"] == (list(range(1, 13)), [r["loss/web"] for r in records])
    assert "tokens/code" not in run.series  # counts are not curves to draw
    out = tmp_path / "mix.png"
    assert plot_metrics.main([str(tmp_path / "mix"), "--out", str(out)]) == 0
    pixels = image.imread(out)[..., :3]
    assert pixels.shape[:2] == (1200, 1200)  # a third row: one panel for each of the two sources
    # The sources' row is painted in the run's colour: both panels hold its curves.
    bottom = pixels[800:]
    for half in (bottom[:, :600], bottom[:, 600:]):
        assert (abs(half - colors.to_rgb("tab:blue")).max(axis=-1) < 0.05).sum() > 100


def moe_records(n: int, z_loss: bool = False) -> list[dict]:
    """A mixture of experts' records as the trainer logs them: two layers' load, the slots, the router losses."""
    return [{**r, "routed_slots": 2048.0, "expert_load/layers.0.moe": 1.5 - r["step"] / 40,
             "expert_load/layers.1.moe": 1.2 + r["step"] / 40, "aux_loss": 2.1 - r["step"] / 100,
             "router_z_loss": 3.0 + r["step"] / 50, **({"z_loss": 40.0 - r["step"]} if z_loss else {})}
            for r in falling(n)]


def test_a_mixture_of_experts_gets_a_row_of_its_load_and_router_losses(tmp_path):
    """The worst layer's load at each step (the console's `load`) and the router losses in a third row, painted in
    the run's colour; a dense run beside it leaves those panels to the MoE run alone, and a dense run alone keeps the
    two rows it had."""
    pytest.importorskip("matplotlib")
    from matplotlib import colors, image

    records = moe_records(12, z_loss=True)
    run = plot_metrics.load_run(write_metrics(tmp_path / "moe" / "metrics.jsonl", records), "moe")
    worst = [max(r["expert_load/layers.0.moe"], r["expert_load/layers.1.moe"]) for r in records]
    assert run.series["load"] == (list(range(1, 13)), worst)
    assert {"aux_loss", "router_z_loss", "z_loss"} <= run.series.keys()
    assert not any(key.startswith("expert_load/") for key in run.series)  # no panel per layer, nor a "source"
    write_metrics(tmp_path / "dense" / "metrics.jsonl", falling(12))
    out = tmp_path / "moe.png"
    assert plot_metrics.main([str(tmp_path / "moe"), str(tmp_path / "dense"), "--out", str(out)]) == 0
    pixels = image.imread(out)[..., :3]
    assert pixels.shape[:2] == (1200, 1200)  # a third row: the load, and the router losses
    def painted(area, color):
        return (abs(area - colors.to_rgb(color)).max(axis=-1) < 0.05).sum()

    bottom = pixels[800:]
    for half in (bottom[:, :600], bottom[:, 600:]):
        assert painted(half, "tab:blue") > 100 and painted(half, "tab:orange") == 0
    dense = tmp_path / "dense.png"
    assert plot_metrics.main([str(tmp_path / "dense"), "--out", str(dense)]) == 0
    assert image.imread(dense).shape[:2] == (800, 1200)


def test_multi_token_predictions_loss_is_drawn_dotted_in_the_loss_panel(tmp_path, monkeypatch):
    """mtp_loss (DeepSeek-V3's MTP, logged apart from the loss) is read and drawn dotted in the loss panel, in the
    run's colour; a run without it draws no such line."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    drawn, real = [], plt.Axes.plot
    monkeypatch.setattr(plt.Axes, "plot",
                        lambda ax, *a, **k: drawn.append((ax, k.get("linestyle"))) or real(ax, *a, **k))
    records = [{**r, "mtp_loss": r["loss"] + 1.0} for r in falling(12)]
    run = plot_metrics.load_run(write_metrics(tmp_path / "mtp" / "metrics.jsonl", records), "mtp")
    assert run.series["mtp_loss"] == (list(range(1, 13)), [r["mtp_loss"] for r in records])
    write_metrics(tmp_path / "plain" / "metrics.jsonl", falling(12))
    for folder, dotted in (("mtp", 1), ("plain", 0)):
        drawn.clear()
        assert plot_metrics.main([str(tmp_path / folder), "--out", str(tmp_path / f"{folder}.png")]) == 0
        assert [ax.get_title() for ax, style in drawn if style == ":"] == ["loss"] * dotted
