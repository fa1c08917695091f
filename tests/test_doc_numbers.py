"""Measured numbers in README and docs/ agree with the result files and tables they come from.

Each claim below is a sentence of a document (a regular expression whose groups are the numbers) and where
each number comes from: a value of `bench/results/*.json` (rewritten by `make bench`), or the table of
another document that reports the experiment. A benchmark rerun that moves a number, or a sentence edited
alone, fails here with both values named. Numbers stated with the commit that measured them (earlier
runs) are history and not checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench/results"


def result(name: str, path: str) -> Callable[[], float]:
    """The value at dotted `path` of bench/results/NAME."""

    def get() -> float:
        node = json.loads((RESULTS / name).read_text())
        for key in path.split("."):
            node = node[key]
        return float(node)

    get.__doc__ = f"bench/results/{name}: {path}"
    return get


def _resume(scale: str, case: str) -> tuple[float, float, float]:
    """bench/results/scale.json's resume on another world size: a node's share and the worst node's bytes
    (MB), and that node's requests."""
    figures = json.loads((RESULTS / "scale.json").read_text())[scale]["resume_reads"]["cases"][case]
    worst = max(figures["nodes"], key=lambda n: n["bytes"])
    return figures["node_share_bytes"] / 1e6, worst["bytes"] / 1e6, worst["requests"]


def _resume_row(head: str, scale: str, case: str) -> tuple:
    """A row of docs/scale.md's resume table (`head`: its label, the share and the worst node's MB; then the
    ratio, the requests and the ratio before) against bench/results/scale.json."""
    where = f"{scale}.resume_reads.cases.{case}"
    return (
        "docs/scale.md",
        head + r", (\d\.\d+)x \| ([\d,]+) \| (?:10.49 GB, )?(\d+)x \|",
        [
            derived(f"scale.json: {scale} {case} node share in MB", lambda: _resume(scale, case)[0]),
            derived(f"scale.json: {scale} {case} worst node in MB", lambda: _resume(scale, case)[1]),
            result("scale.json", f"{where}.node_bytes_over_share.value"),
            derived(f"scale.json: {scale} {case} worst node's requests", lambda: _resume(scale, case)[2]),
            result("scale.json", f"{where}.node_bytes_over_share_before"),
        ],
    )


def derived(doc: str, fn: Callable[[], float]) -> Callable[[], float]:
    fn.__doc__ = doc
    return fn


def _compile_s() -> float:
    cases = json.loads((RESULTS / "compile-cpu.json").read_text())["cases"]
    return cases["vit_s16_64px_compiled"]["warmup_s"] - cases["vit_s16_64px"]["warmup_s"]


def _ema_megabytes() -> float:
    return json.loads((RESULTS / "ema.json").read_text())["zero3"]["ema_bytes_per_rank"] / 1e6


def _e2e_median(workers: str) -> float:
    rounds = json.loads((RESULTS / "shard_planning.json").read_text())["end_to_end"]["rounds"]
    values = sorted(r[workers]["images_per_s"] for r in rounds)
    return values[len(values) // 2]


def _minutes_seconds(shown: str) -> float:
    m, s = re.fullmatch(r"(\d+)m(\d+)s", shown).groups()
    return int(m) * 60 + int(s)


# (document, sentence with one group per number, where each number comes from)
CLAIMS = [
    (
        "docs/sharding.md",
        r"reads the (\d+) parts' footers and writes the summary: ([\d,]+) row groups in a (\d+\.\d+) MB "
        r"`_metadata`\s+\(`bench/results/index.json`, `parts`: (\d\.\d+)x the footer of one file of ([\d,]+) "
        r"groups\)\. Parsing it took\s+(\d\.\d+) s and finding a shard's rows through it (\d\.\d+) s, against "
        r"(\d\.\d+) s and (\d\.\d+) s",
        [
            result("index.json", "layouts.parts.parts"),
            result("index.json", "layouts.parts.row_groups"),
            derived(
                "index.json: the summary in MB",
                lambda: (
                    json.loads((RESULTS / "index.json").read_text())["layouts"]["parts"]["footer_bytes"] / 1e6
                ),
            ),
            result("index.json", "summary_bytes_vs_one_file.value"),
            result("index.json", "layouts.fixed_groups.row_groups"),
            result("index.json", "layouts.parts.open_s"),
            result("index.json", "layouts.parts.lookup_s"),
            result("index.json", "layouts.per_shard.open_s"),
            result("index.json", "layouts.per_shard.lookup_s"),
        ],
    ),
    (
        "README.md",
        r"10M rows: (\d+\.\d+) s of its CPU and (\d+\.\d+) MB",
        [
            result("shard_planning.json", "planning.10000000.driver_cpu_s"),
            result("shard_planning.json", "planning.10000000.driver_peak_rss_mb"),
        ],
    ),
    (
        "docs/sharding.md",
        r"\| driver peak RSS \| (\d+\.\d+) MB \| (\d+\.\d+) MB \| (\d+\.\d+) MB \| (\d+\.\d+) MB \| "
        r"(\d+\.\d+) MB \| <= 1 GB; Parquet flat \(<= 1\.2x\): (\d\.\d+)x",
        [
            result("shard_planning.json", "planning.1000000.driver_peak_rss_mb"),
            result("shard_planning.json", "planning.10000000.driver_peak_rss_mb"),
            result("shard_planning.json", "planning_other.csv.driver_peak_rss_mb"),
            result("shard_planning.json", "planning_other.folder.driver_peak_rss_mb"),
            result("shard_planning.json", "planning_other.flat.driver_peak_rss_mb"),
            result("shard_planning.json", "planning_growth.driver_peak_rss"),
        ],
    ),
    (
        "docs/sharding.md",
        r"\| driver CPU / workers' CPU \| (\d\.\d+) \| (\d\.\d+) \| (\d\.\d+) \| (\d\.\d+) \| (\d\.\d+) \|",
        [
            result("shard_planning.json", "planning.1000000.driver_cpu_share"),
            result("shard_planning.json", "planning.10000000.driver_cpu_share"),
            result("shard_planning.json", "planning_other.csv.driver_cpu_share"),
            result("shard_planning.json", "planning_other.folder.driver_cpu_share"),
            result("shard_planning.json", "planning_other.flat.driver_cpu_share"),
        ],
    ),
    (
        "docs/sharding.md",
        r"The serial planner on the same flat folder: its driver peaked at (\d+\.\d+) MB and spent (\d+\.\d+)"
        r" CPU-seconds,\s+all of the planning. Planned in ranges, the driver's peak is (\d\.\d+)x that and its"
        r" CPU (\d\.\d+)x",
        [
            result("shard_planning.json", "planning_baselines.flat_serial.driver_peak_rss_mb"),
            result("shard_planning.json", "planning_baselines.flat_serial.driver_cpu_s"),
            result("shard_planning.json", "planning_other.flat.driver_peak_rss_vs_serial"),
            result("shard_planning.json", "planning_other.flat.driver_cpu_s_vs_serial"),
        ],
    ),
    (
        "docs/sharding.md",
        r"its workers spent (\d+\.\d+) CPU-seconds against the class\s+folder's (\d+\.\d+)",
        [
            result("shard_planning.json", "planning_other.flat.workers_cpu_s"),
            result("shard_planning.json", "planning_other.folder.workers_cpu_s"),
        ],
    ),
    (
        "docs/sharding.md",
        r"(\d+\.\d+) images/s with 1 worker and (\d+\.\d+) with 2 \(medians\), a speed-up of\s+(\d\.\d+)x",
        [
            derived("shard_planning.json: median workers_1 images/s", lambda: _e2e_median("workers_1")),
            derived("shard_planning.json: median workers_2 images/s", lambda: _e2e_median("workers_2")),
            result("shard_planning.json", "goals.speedup_2_vs_1_workers.value"),
        ],
    ),
    (
        "docs/sharding.md",
        r"the driver spent (\d\.\d+) of the workers'\s+CPU",
        [result("shard_planning.json", "goals.end_to_end_driver_cpu_share.value")],
    ),
    (
        "docs/sharding.md",
        r"The 10M run spent (\d+\.\d+) worker CPU-seconds",
        [result("shard_planning.json", "planning.10000000.workers_cpu_s")],
    ),
    (
        "docs/sharding.md",
        r"ranges, (\d+) spans, (\d+) buckets, (\d+) \(span, range\)\s+and (\d+) \(range, bucket\) pairs",
        [
            result("shard_fanout.json", "fanout.shape.labels_spans"),
            result("shard_fanout.json", "fanout.shape.buckets"),
            result("shard_fanout.json", "fanout.shape.span_range_pairs"),
            result("shard_fanout.json", "fanout.shape.range_bucket_pairs"),
        ],
    ),
    (
        "docs/sharding.md",
        r"the driver peaked at (\d+\.\d+) MB against\s+(\d+\.\d+) MB for the same folder\s+planned as one range: "
        r"(\d\.\d+)x \(goal 1\.25x: met\)",
        [
            result("shard_fanout.json", "fanout.median.fanout.driver_peak_rss_mb"),
            result("shard_fanout.json", "fanout.median.one_range.driver_peak_rss_mb"),
            result("shard_fanout.json", "fanout.goals.driver_peak_rss_vs_one_range.value"),
        ],
    ),
    (
        "docs/sharding.md",
        r"It spent (\d+\.\d+) CPU-seconds, (\d\.\d+) of the workers'\s+\(goal 0\.05:\s+missed\)\. The workers "
        r"spent (\d+\.\d+) CPU-seconds against (\d+\.\d+)",
        [
            result("shard_fanout.json", "fanout.median.fanout.driver_cpu_s"),
            result("shard_fanout.json", "fanout.goals.driver_cpu_share.value"),
            result("shard_fanout.json", "fanout.median.fanout.workers_cpu_s"),
            result("shard_fanout.json", "fanout.median.one_range.workers_cpu_s"),
        ],
    ),
    (
        "README.md",
        r"Loader: (\d+\.\d+)x the plain webdataset",
        [result("loader.json", "speedup_vs_plain_full.full")],
    ),
    (
        "README.md",
        r"(\d+\.\d+)x on shards stored at\s+256 px",
        [result("loader.json", "speedup_vs_plain_full.small")],
    ),
    ("README.md", r"median of (\d+) rounds, 2-core machine", [result("loader.json", "config.repeats")]),
    (
        "README.md",
        r"are held (\d+\.\d+) ms\s+instead of MLflow's synchronous (\d+\.\d+) ms against a local `mlflow server` "
        r"\(`bench/tracking.py`, median of\s+(\d+) log steps",
        [
            result("tracking.json", "backends.mlflow_server.log_step_ms.queued"),
            result("tracking.json", "backends.mlflow_server.log_step_ms.sync"),
            result("tracking.json", "backends.mlflow_server.log_steps_timed_per_mode"),
        ],
    ),
    (
        "README.md",
        r"ZeRO-3 holds (\d+\.\d+)x the model-state bytes of ZeRO-0",
        [result("zero_memory.json", "ratio_zero3_over_zero0")],
    ),
    (
        "docs/cluster.md",
        r"ZeRO-3 holds (\d+\.\d+)x of ZeRO-0",
        [result("zero_memory.json", "ratio_zero3_over_zero0")],
    ),
    (
        "README.md",
        r"a rank keeps (\d+\.\d+) MB of the EMA, 1/(\d+) of the model; its update costs (\d+\.\d+)x the rank's "
        r"AdamW step on the same share; a resume on (\d+) ranks reads each rank's share exactly, from at most (\d+) of",
        [
            derived("bench/results/ema.json: zero3.ema_bytes_per_rank / 1e6", _ema_megabytes),
            result("ema.json", "world"),
            result("ema.json", "zero3.update.ratio_median"),
            result("ema.json", "resume_world"),
            result("ema.json", "zero3.resume.max_files_opened_on_another_world"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| re-deal, a node lost \(1,024 -> 1,016 ranks\) \| (\d\.\d+) s \| (\d\.\d+) s",
        [
            result("scale.json", "jft.deal_s.one_node_lost.value"),
            result("scale.json", "10k.deal_s.one_node_lost.value"),
        ],
    ),
    _resume_row(r"\| 1,016 ranks \(a node lost\) \| (\d+\.\d) MB \| (\d+\.\d) MB", "jft", "one_node_lost"),
    _resume_row(r"\| 512 ranks \(half\) \| (\d+\.\d) MB \| (\d+\.\d) MB", "jft", "half"),
    _resume_row(r"\| 10k scale: 128 -> 120 ranks \| (\d+) MB \| (\d+) MB", "10k", "one_node_lost"),
    (
        "docs/scale.md",
        r"one rank resuming what two saved takes (\d\.\d+) s, (\d\.\d+)x the same-world-size resume's (\d\.\d+) s",
        [
            result("multinode.json", "median_reshard_resume_s"),
            result("multinode.json", "reshard_over_resume"),
            result("multinode.json", "median_resume_s"),
        ],
    ),
    (
        "README.md",
        r"in byte ranges, (\d\.\d+)x a node's share of ViT-H's tag on 1,024 -> 1,016 ranks \(every node downloaded the whole tag before: (\d+)x\)",
        [
            result("scale.json", "jft.resume_reads.cases.one_node_lost.node_bytes_over_share.value"),
            result("scale.json", "jft.resume_reads.cases.one_node_lost.node_bytes_over_share_before"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| re-deal, half \(1,024 -> 512 ranks\) \| (\d\.\d+) s \| (\d\.\d+) s",
        [result("scale.json", "jft.deal_s.half.value"), result("scale.json", "10k.deal_s.half.value")],
    ),
    (
        "docs/scale.md",
        r"\| data position, as checkpointed once \| ([\d,]+) bytes \| ([\d,]+) bytes",
        [
            result("scale.json", "jft.data_position_bytes.value"),
            result("scale.json", "10k.data_position_bytes.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| bytes received at start-up \| ([\d,]+) \| ([\d,]+) \|",
        [
            result("scale.json", "jft.startup_received_bytes.value"),
            result("scale.json", "10k.startup_received_bytes.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| the same, before \(every rank's record gathered\) \| ([\d,]+) \| ([\d,]+) \|",
        [
            result("scale.json", "jft.startup_received_before_records_gathered"),
            result("scale.json", "10k.startup_received_before_records_gathered"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| share of the split's samples an epoch uses \| (\d\.\d+) \| (\d\.\d+) \|",
        [
            result("scale.json", "jft.epoch_share_used.value"),
            result("scale.json", "10k.epoch_share_used.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| the same, before \(whole shards, every slot the worst share\) \| (\d\.\d+) \| (\d\.\d+) \|",
        [
            result("scale.json", "jft.epoch_share_used_whole_shards"),
            result("scale.json", "10k.epoch_share_used_whole_shards"),
        ],
    ),
    (
        "docs/scale.md",
        r"\| samples read past at the head of a run \(never decoded\) \| (\d\.\d+) \| (\d\.\d+) \|",
        [
            result("scale.json", "jft.epoch_read_past.value"),
            result("scale.json", "10k.epoch_read_past.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"read the 21 MB manifest, pack it \| (\d\.\d+) s, \+(\d+\.\d) MB RSS \| (\d\.\d+) s, \+(\d+\.\d) MB",
        [
            result("scale.json", "jft.startup_rank0_s.value"),
            result("scale.json", "jft.startup_rank0_rss_mb.value"),
            result("scale.json", "10k.startup_rank0_s.value"),
            result("scale.json", "10k.startup_rank0_rss_mb.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"unpack the broadcast \| (\d\.\d+) s, \+(\d+\.\d) MB RSS \| (\d\.\d+) s, \+(\d+\.\d) MB",
        [
            result("scale.json", "jft.startup_rank_s.value"),
            result("scale.json", "jft.startup_rank_rss_mb.value"),
            result("scale.json", "10k.startup_rank_s.value"),
            result("scale.json", "10k.startup_rank_rss_mb.value"),
        ],
    ),
    (
        "docs/scale.md",
        r"every rank read the manifest\) \| (\d\.\d+) s, \+(\d+\.\d) MB RSS \| (\d\.\d+) s, \+(\d+\.\d) MB",
        [
            result("scale.json", "jft.startup_rank_before.seconds"),
            result("scale.json", "jft.startup_rank_before.peak_rss_mb"),
            result("scale.json", "10k.startup_rank_before.seconds"),
            result("scale.json", "10k.startup_rank_before.peak_rss_mb"),
        ],
    ),
    (
        "docs/scale.md",
        r"- ([\d,]+) bytes of tag names gathered.*\n- ([\d,]+) bytes: the chosen COMPLETE.json(?:.*\n)+?- ([\d,]+) "
        r"bytes: the local tag lists(?:.*\n)+?- ([\d,]+) bytes: the dataset broadcast(?:.*\n)+?- ([\d,]+) bytes: the "
        r"data position, broadcast",
        [
            result("scale.json", f"jft.startup_received_parts.{part}")
            for part in (
                "tag_names_gathered",
                "chosen_record_broadcast",
                "local_tags_gathered",
                "dataset_broadcast",
                "data_position_broadcast",
            )
        ],
    ),
    (
        "README.md",
        r"a re-deal on 1,016 ranks takes (\d\.\d+) s and its data position, written once per\s+checkpoint, is ([\d,]+) bytes",
        [
            result("scale.json", "jft.deal_s.one_node_lost.value"),
            result("scale.json", "jft.data_position_bytes.value"),
        ],
    ),
    (
        "README.md",
        r"`bench/results/compile-cpu.json` holds the (\d+\.\d+) run",
        [result("compile-cpu.json", "compiled_over_eager_images_per_s")],
    ),
    (
        "README.md",
        r"per block the stored run\s+compiled for about (\d+) s",
        [derived("compile-cpu.json: compiled warm-up minus eager warm-up", _compile_s)],
    ),
    (
        "docs/gpu.md",
        r"MFU ViT-B/16 >= (0\.\d+), ViT-H/14 >= (0\.\d+), MAE-H/14 >= (0\.\d+)",
        [
            result("compile-cpu.json", "goals.vit_b16.mfu_goal"),
            result("compile-cpu.json", "goals.vit_h14.mfu_goal"),
            result("compile-cpu.json", "goals.mae_vit_h14.mfu_goal"),
        ],
    ),
    (
        "README.md",
        r"Measured on a 2-core machine without a GPU \([^)]*\): (\d+m\d+s) after set-up",
        [result("demo.json", "wall_s")],
    ),
    (
        "README.md",
        r"digits top-1 (\d\.\d+) after MAE pretraining against (\d\.\d+) from scratch, few-shot 10-shot (\d\.\d+) and\s+(\d\.\d+)",
        [
            result("demo.json", "top1.finetune"),
            result("demo.json", "top1.finetune_scratch"),
            result("demo.json", "fewshot_10shot.finetune"),
            result("demo.json", "fewshot_10shot.finetune_scratch"),
        ],
    ),
]

CLAIMS += [
    (
        doc,
        r"held the step (\d\.\d+) s, against (\d+\.\d) s for the same save done synchronously, so a stage saving every 100\s+steps of (\d\.\d+) s spends (\d\.\d+)% of its time held",
        [
            result("multinode.json", "median_async_stall_s"),
            result("multinode.json", "median_save_s"),
            result("multinode.json", "median_step_s"),
            derived(
                "multinode.json: stall_fraction.value in %",
                lambda: 100 * result("multinode.json", "stall_fraction.value")(),
            ),
        ],
    )
    for doc in ["docs/scale.md"]
] + [
    (
        "README.md",
        r"was held (\d\.\d+) s per save\s+against (\d+\.\d) s saving synchronously, (\d\.\d+)% of a stage",
        [
            result("multinode.json", "median_async_stall_s"),
            result("multinode.json", "median_save_s"),
            derived(
                "multinode.json: stall_fraction.value in %",
                lambda: 100 * result("multinode.json", "stall_fraction.value")(),
            ),
        ],
    ),
    (
        "docs/scale.md",
        r"goal 1%; (\d+\.\d)% synchronously\)\. On this 2-core machine the\s+background work also slows the steps it overlaps, by (\d+\.\d) s in all \(4 steps until the save was\s+complete\): (\d\.\d)% with it",
        [
            derived(
                "multinode.json: sync_stall_fraction in %",
                lambda: 100 * result("multinode.json", "sync_stall_fraction")(),
            ),
            result("multinode.json", "median_contention_s"),
            derived(
                "multinode.json: stall_fraction_with_contention in %",
                lambda: 100 * result("multinode.json", "stall_fraction_with_contention")(),
            ),
        ],
    ),
]

# (document, sentence quoting an experiment's result, the document whose table reports it)
QUOTES = [
    ("README.md", r"\(500 steps:\s+(\d\.\d+ ± \d\.\d+) against (\d\.\d+ ± \d\.\d+)\)", "docs/pretraining.md"),
    ("README.md", r"AP@\[\.5:\.95\] (\d\.\d+ ± \d\.\d+) from the MAE encoder", "docs/detection.md"),
    ("README.md", r"against (\d\.\d+ ± \d\.\d+) from scratch, where two of three", "docs/detection.md"),
]


def _matches(doc: str, pattern: str) -> list[re.Match]:
    """Where `pattern` is in `doc`, once; a space in it matches any run of whitespace (lines wrap)."""
    found = list(re.finditer(pattern.replace(" ", r"\s+"), (ROOT / doc).read_text()))
    assert len(found) == 1, f"{doc}: expected the sentence /{pattern}/ once, found it {len(found)} times"
    return found


@pytest.mark.parametrize("doc, pattern, sources", CLAIMS, ids=[f"{d}:{p[:40]}" for d, p, _ in CLAIMS])
def test_a_measured_number_is_its_result_files(doc, pattern, sources):
    (match,) = _matches(doc, pattern)
    assert len(match.groups()) == len(sources)
    for shown, source in zip(match.groups(), sources):
        value = source()
        if "m" in shown:  # 4m14s
            assert abs(_minutes_seconds(shown) - value) < 1.0, (
                f"{doc}: {shown}, but {source.__doc__} is {value:.1f} s"
            )
            continue
        shown = shown.replace(",", "")  # 1,092,206
        digits = len(shown.partition(".")[2])
        assert abs(float(shown) - value) <= 0.5 * 10**-digits + 1e-9, (
            f"{doc}: {shown}, but {source.__doc__} is {value} ({round(value, digits)} at the digits shown): "
            "rerun the benchmark or correct the sentence"
        )


@pytest.mark.parametrize("doc, pattern, table", QUOTES, ids=[f"{d}:{p[:40]}" for d, p, _ in QUOTES])
def test_a_quoted_result_is_in_the_table_that_reports_it(doc, pattern, table):
    (match,) = _matches(doc, pattern)
    rows = [line for line in (ROOT / table).read_text().splitlines() if line.startswith("|")]
    for shown in match.groups():
        assert any(shown in row for row in rows), f"{doc} quotes {shown}, which no table row of {table} shows"


def test_the_loader_cost_per_core_range_holds_the_measured_one():
    (match,) = _matches("README.md", r"costs about (\d+)-(\d+) images/s per CPU core")
    low, high = map(int, match.groups())
    measured = result("loader.json", "images_per_cpu_s.plain_full")()
    assert low <= measured <= high, f"README says {low}-{high} images/s per core; loader.json: {measured}"


def test_every_result_file_a_claim_reads_exists():
    named = {
        re.search(r"bench/results/(\S+):", s.__doc__).group(1)
        for _, _, srcs in CLAIMS
        for s in srcs
        if s.__doc__.startswith("bench")
    }
    assert named <= {p.name for p in RESULTS.glob("*.json")}, named
