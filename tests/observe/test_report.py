"""``meshtrain report``: a run folder (built here with run_files' writers and CSVLogger, no
training: every section) becomes one self-contained report.html. The report a real fit
writes, opened in headless Chromium: test_fit_report.py."""

from __future__ import annotations

import re
import shutil
from html import unescape
from pathlib import Path
from urllib.parse import unquote

import pytest

from meshtrain.cli import main
from meshtrain.config import dumps_toml
from meshtrain.errors import ConfigError
from meshtrain.observe import run_files
from meshtrain.observe.loggers import CSVLogger
from meshtrain.observe.report import write_report

pytestmark = pytest.mark.timeout(120)

SECTIONS = ("summary", "config", "environment", "loss", "throughput", "breakdown", "memory",
            "experts", "pipeline", "events", "traces", "missing")
FIGURES = ("loss", "throughput", "breakdown", "memory", "pipeline")
PNG = '<img src="data:image/png;base64,'
GIB = 2**30


def breakdown_row(step: int, rank: int, compute: float, comm: float = 0.1) -> dict:
    parts = {"data": 0.02, "compute": compute, "comm": comm, "bubble": 0.05,
             "optimizer": 0.03, "checkpoint": 0.0, "other": 0.01}
    return {"step": step, "rank": rank, "wall_s": sum(parts.values()) + 0.01,
            "step_s": sum(parts.values()),
            **{f"{p}_s": s for p, s in parts.items()},
            "mem_peak_bytes": (10 + rank) * GIB, "mem_limit_bytes": 80 * GIB}


def make_run(root: Path, *, straggler: int = 3, steps=(10, 20, 30), status="finished") -> Path:
    """A finished 4-rank dp=2;pp=2 run of ``steps``; ``straggler``'s compute is 50% longer
    in every interval; the user logged ``val_acc`` and ``train/acc``."""
    run = root / "tiny" / "20260101-000000"
    run.mkdir(parents=True)
    config = {"trainer": {"layout": "dp=2;pp=2", "max_steps": steps[-1], "plan_cluster": None},
              "logging": {"name": "tiny", "root_dir": str(root), "loggers": ["csv"]}}
    (run / "config.toml").write_text(dumps_toml(config))
    run_files.update_environment(
        run, torch="2.13.0", python="3.12", hostname="node0", device_type="cuda",
        device_name="NVIDIA H100", world_size=4, layout="dp=2;pp=2", unit="tokens",
        flops_per_item=6.0e6, peak_tflops=989.0, peak_source="H100 SXM bf16 dense",
        started="2026-01-01T00:00:00+00:00", status="running", error=None)
    logger = CSVLogger(run)
    for step in steps:
        logger.log_metrics({"train/loss": 4.0 / step ** 0.5, "train/tokens_per_s": 5e4 + step,
                            "train/mfu": 0.3 + step / 1000, "train/tflops": 300.0,
                            "epoch": 0.0}, step)
        logger.log_metrics({"val/loss": 4.2 / step ** 0.5, "val_acc": 0.5 + step / 100}, step)
        logger.log_metrics({"train/acc": 0.25 + step / 100}, step)
        run_files.append_breakdown(run, [
            breakdown_row(step, r, 0.6 if r == straggler else 0.4) for r in range(4)])
    logger.finalize()
    (run / "checkpoints" / "step_10").mkdir(parents=True)
    (run / "stacks").mkdir()
    (run / "stacks" / "watchdog rank1.txt").write_text("Thread 0x1 (most recent call first)\n")
    run_files.append_event(run, "checkpoint", "saved", 10, run / "checkpoints" / "step_10")
    run_files.append_event(run, "skip", "non-finite loss: step skipped", 12)
    run_files.append_event(run, "watchdog", "rank 1 stalled <for 240 s>", 15,
                           run / "stacks" / "watchdog rank1.txt")
    run_files.append_event(run, "restart", "restarted from checkpoints/step_10", 10)
    run_files.append_event(run, "straggler", f"rank {straggler} is slow", steps[-1])
    run_files.write_json(run / run_files.PIPELINE, {
        "schedule": "1f1b", "pp": 2, "microbatches": 4, "stages_per_rank": 1, "step": 5,
        "measured_bubble": 0.27, "formula_bubble": 0.2, "free_comm_bubble": 0.23,
        "events": [[r, r, m, k, 0.01 * (2 * m + r + (k == "B") * 8),
                    0.01 * (2 * m + r + (k == "B") * 8) + 0.009]
                   for r in range(2) for m in range(4) for k in "FB"]})
    (run / "traces").mkdir()
    for r in range(2):
        (run / "traces" / f"rank{r}.json").write_text('{"traceEvents": []}\n')
    (run / "memory.txt").write_text("model state on this rank (MiB): 1.0 <params>\n")
    run_files.update_environment(run, status=status, finished="2026-01-01T01:00:00+00:00",
                                 error="RuntimeError: boom" if status == "failed" else None)
    return run


def sections(html: str) -> dict[str, str]:
    """Each ``<section id=...>``'s inner HTML by id."""
    found = re.findall(r'<section id="([^"]+)">(.*?)</section>', html, re.S)
    return dict(found)


def text(html: str) -> str:
    """The visible text, tags removed and spaces collapsed."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> tuple[Path, str]:
    run = make_run(tmp_path_factory.mktemp("runs"))
    return run, write_report(run).read_text()


def test_a_complete_run_has_every_section_with_its_figure(complete):
    run, html = complete
    found = sections(html)
    assert tuple(found) == SECTIONS
    for name in FIGURES:
        assert found[name].count(PNG) == 1, name
    assert html.count(PNG) == len(FIGURES)
    assert "Not recorded" not in html
    assert "Nothing: the run folder holds every file" in found["missing"]
    summary = text(found["summary"])
    assert "status finished" in summary and "steps 30 of 30" in summary
    assert "final validation loss 0.7668" in summary  # 4.2 / sqrt(30)
    assert "989" in found["throughput"] and "H100 SXM bf16 dense" in found["throughput"]
    assert "measured bubble 0.27" in text(found["pipeline"])
    assert "bubble with free communication (the stages' own times) 0.23" in text(
        found["pipeline"])
    assert "1 checkpoints 1 restarts 1 skipped steps 0 rollbacks" in text(found["events"])
    assert "[trainer]" in found["config"] and "plan_cluster none" in text(found["config"])
    assert "&lt;params&gt;" in found["memory"]  # memory.txt escaped in its <pre>
    assert sorted(p.name for p in run.iterdir() if "report" in p.name) == ["report.html"]


@pytest.mark.parametrize("straggler", [1, 3])
def test_the_straggler_rank_is_named_in_the_breakdown(tmp_path, straggler):
    run = make_run(tmp_path, straggler=straggler, steps=(10, 20, 30, 40))
    found = sections(write_report(run).read_text())
    breakdown = text(found["breakdown"])
    assert (f"Straggler at step 40: rank {straggler}, its own work (step minus comm and "
            "bubble, where a rank waits for the others) 0.66 s per step, 43% above the other "
            "ranks' median (0.46 s), and above it by more than 0.092 s: the largest of 20% of "
            "that median, the other ranks' spread and 3x its jitter (0 s, the median change "
            "of its lead over them from one interval to the next) in each of the last 4 "
            "logging intervals.") in breakdown
    (slow_row,) = re.findall(r'<tr class="straggler"><td>(\d+)', found["breakdown"])
    assert int(slow_row) == straggler
    for part, doc in run_files.PART_DOCS.items():
        assert f"{part} {doc}" in breakdown


def test_three_intervals_are_too_few_to_name_a_straggler(complete):
    breakdown = text(sections(complete[1])["breakdown"])  # rank 3 slower in all three
    assert ("All 4 ranks: 0.81 s per step at step 30; their own work (step minus comm and "
            "bubble) 0.46-0.66 s: 3 logging interval(s), too few to tell a straggler from "
            "noise (a rank is named after 3 in a row, with 4 recorded).") in breakdown


def test_ranks_equally_fast_name_no_straggler(tmp_path):
    run = make_run(tmp_path, straggler=-1, steps=(10, 20, 30, 40))
    breakdown = sections(write_report(run).read_text())["breakdown"]
    assert ("All 4 ranks: 0.61 s per step at step 40; their own work (step minus comm and "
            "bubble) 0.46-0.46 s: no straggler (none above the other ranks' median by more "
            "than a straggler's lead, 3 logging intervals in a row; rank 0's would be more "
            "than 0.092 s") in text(breakdown)
    assert "straggler<" not in breakdown and 'class="straggler"' not in breakdown


def test_event_links_are_relative_and_point_at_existing_files(complete):
    run, html = complete
    found = sections(html)
    hrefs = re.findall(r'href="([^"]*)"', found["events"] + found["traces"])
    assert len(hrefs) == 5  # the checkpoint (listed, and its event), the stack dump, 2 traces
    for href in hrefs:
        assert "://" not in href and not href.startswith("/"), href
        assert (run / unquote(href)).exists(), href
    assert "stacks/watchdog%20rank1.txt" in hrefs
    assert "&lt;for 240 s&gt;" in found["events"]  # messages are escaped


def test_an_event_whose_file_is_gone_is_not_linked_and_is_listed_missing(tmp_path):
    run = make_run(tmp_path)
    shutil.rmtree(run / "checkpoints" / "step_10")
    found = sections(write_report(run).read_text())
    assert "checkpoints/step_10 (not found)" in text(found["events"])
    assert 'href="checkpoints' not in found["events"]
    assert "Checkpoints in the run folder" not in found["events"]
    assert "checkpoints/step_10 (named by a checkpoint event at step 10) is not in the run " \
           "folder" in text(found["missing"])


def test_the_summary_has_every_metric_the_user_logged(complete):
    summary = text(sections(complete[1])["summary"])
    assert "final val_acc 0.8 (step 30)" in summary
    assert "final train/acc 0.55 (step 30)" in summary  # under train/, and still the user's
    assert "tokens_per_s" not in summary and "final epoch" not in summary  # (elsewhere)


def test_checkpoints_keep_last_k_rotated_away_are_not_missing_but_a_deleted_one_is(tmp_path):
    """keep_last_k = 2 and checkpoints at steps 10, 20, 30: the writer removed step 10 (two
    newer ones were saved); step 20 is gone too, by hand: that one is missing."""
    run = make_run(tmp_path)
    config = (run / "config.toml").read_text()
    (run / "config.toml").write_text(config + "\n[checkpoint]\nkeep_last_k = 2\n")
    for step in (20, 30):
        (run / "checkpoints" / f"step_{step}").mkdir()
        run_files.append_event(run, "checkpoint", "saved", step, run / "checkpoints" /
                               f"step_{step}")
    shutil.rmtree(run / "checkpoints" / "step_10")
    shutil.rmtree(run / "checkpoints" / "step_20")
    found = sections(write_report(run).read_text())
    events, missing = text(found["events"]), text(found["missing"])
    assert ("checkpoints/step_10 (removed: rotated away by keep_last_k = 2 (the newest 2 "
            "periodic checkpoints are kept))") in events
    assert ("Checkpoints the run removed on purpose (normal, not missing): checkpoints/step_10 "
            "(rotated away by keep_last_k = 2") in events
    assert "step_10" not in missing
    assert "checkpoints/step_20 (not found)" in events
    assert ("checkpoints/step_20 (named by a checkpoint event at step 20) is not in the run "
            "folder, and the run did not remove it") in missing


def test_the_page_loads_nothing_from_the_network(complete):
    _, html = complete
    for url in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', html, re.I):
        assert url.startswith(("data:", "#")) or not re.match(r"[a-z][a-z0-9+.-]*:|/", url,
                                                             re.I), url
    assert not re.search(r"<script[^>]*\bsrc|<link[^>]*stylesheet|@import|url\(", html, re.I)
    assert "https://ui.perfetto.dev" in html  # named as text to open, not fetched


def test_a_killed_run_gives_a_partial_report_saying_what_is_missing(tmp_path):
    run = make_run(tmp_path, status="running")
    run_files.update_environment(run, finished=None)
    for name in ("pipeline.json", "memory.txt"):
        (run / name).unlink()
    for name in ("breakdown.csv", "metrics.csv"):  # killed while writing step 40's line
        with open(run / name, "a") as f:
            f.write("40,0,0.5")
    found = sections(write_report(run).read_text())
    assert tuple(found) == SECTIONS
    assert "status running or killed" in text(found["summary"])
    missing = text(found["missing"])
    for sentence in ("breakdown.csv's last line was cut short", "metrics.csv's last line was "
                     "cut short", 'environment.json says "running" and has no finish time',
                     "no readable pipeline.json", "no memory.txt"):
        assert sentence in missing, sentence
    assert "steps 30 of 30" in text(found["summary"])  # the cut step 40 is left out
    assert "Not recorded: no readable pipeline.json" in text(found["pipeline"])
    assert found["breakdown"].count(PNG) == 1 and found["pipeline"].count(PNG) == 0


def test_a_run_with_only_metrics_has_every_section_saying_what_is_not_recorded(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train/loss": 2.0}, 1)
    logger.finalize()
    found = sections(write_report(tmp_path).read_text())
    assert tuple(found) == SECTIONS
    assert found["loss"].count(PNG) == 1
    for name in ("config", "environment", "breakdown", "memory", "events", "traces"):
        assert "Not recorded:" in found[name], name
    assert "layout has no pipeline stages" in found["pipeline"]
    missing = text(found["missing"])
    for sentence in ("no config.toml", "no readable environment.json",
                     "no breakdown.csv: the run stopped before its first logging interval",
                     "no throughput", "no train/mfu"):
        assert sentence in missing, sentence
    assert "pipeline" not in missing  # not a pp layout: nothing is missing


def test_a_failed_run_shows_its_error(tmp_path):
    summary = sections(write_report(make_run(tmp_path, status="failed")).read_text())["summary"]
    assert "status failed" in text(summary) and "error RuntimeError: boom" in text(summary)


def test_a_folder_that_is_not_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"not a run folder: it has none of config.toml, "
                                          r"metrics.csv, environment.json.*<name>/<timestamp>"):
        write_report(tmp_path)
    make_run(tmp_path)
    with pytest.raises(ConfigError, match=r"it holds runs, the latest .*tiny/20260101-000000"):
        write_report(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(tmp_path / "nowhere")


def test_the_report_command_prints_the_page_and_exits_2_on_a_bad_folder(tmp_path, capsys):
    run = make_run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert (run / "report.html").is_file()
    assert main(["report", str(tmp_path / "tiny")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtrain: error: ") and "is not a run folder" in err
    with pytest.raises(SystemExit) as exit_:
        main(["report"])
    assert exit_.value.code == 2


def test_the_world_size_names_the_nodes_of_a_multi_node_run():
    from meshtrain.observe.report.render import _world

    assert _world({"world_size": 4, "nodes": 2, "processes_per_node": 2}) == "4 (2 nodes x 2)"
    assert _world({"world_size": 2, "nodes": 1, "processes_per_node": 2}) == "2"
    assert _world({"world_size": 2}) == "2"  # a run folder written before nodes were recorded
