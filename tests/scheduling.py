"""How the suite is spread over pytest-xdist workers: `make test` runs `pytest -n 5 --dist loadgroup`.

Most of the suite's wall time is waiting (Ray Train start-up, torchrun rendezvous, job polling), so five
workers on two cores overlap the waiting. Two rules keep that correct and fast:
- Tests that share an expensive fixture run on one worker (an `xdist_group`), so the fixture is built once:
  a module-scoped fixture defined in a test module groups that module's users; the Ray tests split into three
  groups, each with its own local cluster (started for the group, stopped after its last test).
- The longest units are handed out first (xdist gives work in collection order), so no long test starts
  last and holds the run open while the other workers idle.
Without xdist (`pytest tests/test_x.py`) the groups are ignored and the order is the same as ever within a
file.
"""

import os

import pytest

# The Ray tests split over three local clusters (one per group), each group a few minutes long; the
# rest (first-named tests and any new Ray test) run on "ray_a".
RAY_GROUPS = {
    "test_a_killed_node_recovers_with_the_weights_of_an_uninterrupted_run": "ray_b",
    "test_retries_exhausted_fail_the_job_and_the_mlflow_runs": "ray_b",
    "test_the_detection_experiment_runs_as_ray_stages_in_a_tiny_variant": "ray_b",
    "test_thin_run_on_two_ray_workers": "ray_c",
    "test_segmentation_stages_run_as_ray_stages": "ray_c",
    "test_an_elastic_stage_that_loses_a_node_goes_on_on_the_rest": "ray_c",
}
# Tests that take minutes: started before everything else, longest first. Seconds as measured inside a
# full `make test` (2 cores, 5 workers, so several times their time alone; 2026-12-03); a group's weight is
# its longest test's, so a Ray group's first test carries the whole group's time (cluster start included).
# tools/test_cpu.py measures them (wall and CPU per test, children and Ray daemons included).
LONG_TESTS = {
    "test_nodes_that_share_only_the_bucket_and_mlflow_run_stop_and_resume_an_experiment": 1140,  # ray_a
    "test_a_killed_node_recovers_with_the_weights_of_an_uninterrupted_run": 910,  # ray_b: retries, detection
    "test_reduced_demo_runs_end_to_end": 880,
    "test_segmentation_stages_run_as_ray_stages": 640,  # ray_c: with the thin run and the elastic stage
    "test_two_ranks_resume_on_one_per_zero_stage": 560,
    "test_two_ranks_give_the_single_process_result": 470,  # its module fixture: both evaluations
    "test_setr_trains_from_an_mae_encoder_under_every_zero_stage_and_reports_miou": 400,
    "test_compiled_model_trains_like_eager_under_zero3": 280,  # compiles on both ranks
    "test_each_family_trains_under_every_zero_stage_with_distillation_and_simmim": 260,
    "test_detr_trains_from_an_mae_encoder_under_every_zero_stage_and_reports_box_ap": 250,
    "test_gpu_bench_dry_run_runs_every_case_on_cpu": 230,  # five engines, a dataset and three loaders
    "test_one_rank_resumes_on_two_per_zero_stage_in_bf16": 210,
    "test_a_stage_saved_by_four_ranks_on_two_nodes_goes_on_on_two_and_on_four_reading_its_share": 260,
    "test_no_host_read_between_log_steps": 140,  # its module fixture: every case in one launch
    "test_sigterm_checkpoints_and_resume_falls_back_past_a_corrupt_checkpoint": 150,
    "test_every_objective_trains_and_its_loss_falls": 140,
    "test_resume_is_bitwise_exact_per_zero_stage": 135,
    "test_every_family_and_objective_trains_in_bf16": 130,  # its module: 90 engines in one process
    "test_same_seed_same_losses_on_cpu": 115,
    "test_checkpoints_on_s3_resume_a_run_whose_local_directory_is_gone": 90,
    "test_a_private_local_ray_and_its_train_workers_listen_only_on_loopback": 85,
    "test_ranks_without_a_shared_disk_prune_their_own_and_agree_on_what_to_resume": 80,
    "test_export_is_assembled_in_memory_and_equals_zero_to_fp32": 75,
    "test_a_single_process_training_run_listens_only_on_loopback": 65,
    "test_vitpipe_compare_command": 45,
}


def _group(item: pytest.Item) -> str | None:
    if "ray_cluster" in item.fixturenames:
        return RAY_GROUPS.get(item.originalname, "ray_a")
    module = item.module.__name__ if item.module else None
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            # A module-scoped fixture of the test's own file: its users share one worker and one build.
            if fixturedef.scope == "module" and fixturedef.func.__module__ == module:
                return f"{module}.{name}"
    return None


def _weight(item: pytest.Item) -> float:
    if item.originalname in LONG_TESTS:
        return LONG_TESTS[item.originalname]
    return 10 if any(item.get_closest_marker(m) for m in ("slow", "dist", "ray")) else 0


def order_and_group(items: list[pytest.Item]) -> None:
    """Mark the shared-fixture groups, then order by unit (a group, or one test), longest unit first.

    A group's tests stay next to each other: pytest tears a module-scoped fixture down as soon as the next
    test on the same worker (or in a plain run) is from another module, and would build it again.
    """
    units: dict[str, list[int]] = {}
    units_of: dict[int, str] = {}
    for index, item in enumerate(items):
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        units_of[index] = group or item.nodeid
        units.setdefault(units_of[index], []).append(index)
    key: dict[int, tuple[float, int, int]] = {}
    for members in units.values():
        weight = max(_weight(items[i]) for i in members)
        for i in members:
            key[i] = (-weight, members[0], i)
    order = sorted(range(len(items)), key=key.__getitem__)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        # xdist hands each worker a second unit up front, queued behind its first: after the first
        # `workers` units (the longest) come `workers` one-test units of no weight, so no long unit
        # waits minutes behind the demo.
        firsts = sorted({units_of[i] for i in order}, key=lambda u: key[units[u][0]])
        heads = [units[u][0] for u in firsts[:workers]]
        light = [i for i in order if _weight(items[i]) == 0 and len(units[units_of[i]]) == 1][:workers]
        cut = max(order.index(h) + len(units[units_of[h]]) for h in heads) if heads else 0
        rest = [i for i in order[cut:] if i not in light]
        order = order[:cut] + light + rest
    items[:] = [items[i] for i in order]


def in_fast_tier(item: pytest.Item) -> bool:
    """Whether `make test-fast` (`-m "unit and not slow and not dist and not ray"`) runs this test."""
    return bool(item.get_closest_marker("unit")) and not any(
        item.get_closest_marker(m) for m in ("slow", "dist", "ray")
    )


def check_tiers(items: list[pytest.Item]) -> None:
    """`make test-fast` selects by marker (`unit and not slow and not dist and not ray`): a test that starts
    or joins a local Ray cluster must say so with the `ray` marker, or the fast tier would wait on clusters."""
    unmarked = [
        i.nodeid for i in items if "ray_cluster" in i.fixturenames and not i.get_closest_marker("ray")
    ]
    if unmarked:
        raise pytest.UsageError(f"tests on a Ray cluster without the `ray` marker: {unmarked}")


def check_groups_applied(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`, xdist marks a group by renaming each test's node id (`...@group`); a
    pytest whose node id ignores that (pytest 9 with xdist 3.8) groups nothing, silently: every Ray
    test then starts its own cluster and shared fixtures are built once per test. Fail loudly instead."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"xdist --dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): this pytest and "
            "pytest-xdist disagree on node ids; install the versions pyproject.toml's dev extra pins"
        )
