"""vitpipe submit's pre-upload checks (no cluster needed)."""

import sys
from pathlib import Path

import pytest

from cluster import submit

pytestmark = pytest.mark.unit


def test_excluded_folders_do_not_count_and_an_oversized_working_dir_is_refused(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "code.py").write_text("x = 1\n")
    for excluded in (".git", ".venv", "data", "runs"):
        (tmp_path / excluded).mkdir()
        (tmp_path / excluded / "big.bin").write_bytes(b"\0" * 4096)
    (tmp_path / "mlflow.db").write_bytes(b"\0" * 4096)
    assert submit.check_upload(tmp_path) == len("x = 1\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "huge.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(submit.SubmitError, match=r"over the Jobs API limit.*largest: notes"):
        submit.check_upload(tmp_path, limit=2048)


def test_a_bad_config_fails_before_any_upload(tmp_path, monkeypatch):
    def no_client(address):  # submit must not reach the cluster with a broken config
        raise AssertionError("contacted the cluster")

    monkeypatch.setattr(submit, "client", no_client)
    from pipeline.config import ConfigError

    root = Path(__file__).parents[1]
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        submit.submit(
            str(root / "configs/experiments/smoke.yaml"),
            ["optim.lrr=1"],
            None,
            python=sys.executable,
            root=root,
        )
    assert submit.submission_id("demo").startswith("demo-")


def test_a_relative_run_dir_or_store_and_a_missing_token_are_refused_before_any_upload(tmp_path, monkeypatch):
    """A relative run_dir (the default runs/{name} too) or SQLite path would resolve inside the job's copy of
    the working directory; no token means the Jobs API refuses the upload. Both fail here, naming what to
    write, before the cluster is contacted."""

    def no_client(address):
        raise AssertionError("contacted the cluster")

    monkeypatch.setattr(submit, "client", no_client)
    root = Path(__file__).parents[1]
    two_stage = str(root / "configs/experiments/two_stage_tiny.yaml")  # no run_dir: the default
    with pytest.raises(submit.SubmitError, match=r"run_dir 'runs/\{name\}' is a relative path.*/shared/runs"):
        submit.submit(two_stage, [], None, root=root)
    for overrides in (["run_dir=runs/mine"], [f"run_dir={tmp_path}", "tracking.uri=sqlite:///runs/m.db"]):
        with pytest.raises(submit.SubmitError, match="is a relative path"):
            submit.check_paths_written(two_stage, overrides)
    for fine in ([f"run_dir={tmp_path}"], [f"run_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]):
        submit.check_paths_written(two_stage, fine)
    submit.check_paths_written(two_stage, [f"run_dir={tmp_path}", "tracking.uri=http://127.0.0.1:5000"])
    for store in ("mlruns", "./mlruns", "file:mlruns"):  # MLflow file stores by a relative path
        with pytest.raises(submit.SubmitError, match=rf"tracking.uri '{store}' is a relative path"):
            submit.check_paths_written(two_stage, [f"run_dir={tmp_path}", f"tracking.uri={store}"])
    for store in (f"file://{tmp_path}/mlruns", "databricks", "postgresql://db:5432/mlflow"):
        submit.check_paths_written(two_stage, [f"run_dir={tmp_path}", f"tracking.uri={store}"])
    with pytest.raises(
        submit.SubmitError, match="run_dir 'r' and tracking.uri 'sqlite:///m.db' are relative"
    ):
        submit.check_paths_written(two_stage, ["run_dir=r", "tracking.uri=sqlite:///m.db"])

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(
        submit.SubmitError, match=rf"no Ray auth token: {tmp_path}/.ray/auth_token is missing"
    ):
        submit.submit(two_stage, [f"run_dir={tmp_path}"], None, root=root)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret\n")
    submit.check_token()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "elsewhere"))
    with pytest.raises(submit.SubmitError, match="elsewhere is missing or empty"):
        submit.check_token()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    submit.check_token()


def test_a_run_dir_inside_the_jobs_working_directory_copy_is_refused(tmp_path, monkeypatch):
    """Inside `ray job submit --working-dir`, the driver runs in Ray's temporary copy of the project: a
    relative run_dir would land there, deleted with the job and on no other node. Refused, with the path."""
    import json

    from cluster.preflight import JOB_CONFIG_ENV, check_not_in_job_copy, job_working_dir
    from pipeline.config import ConfigError, load_experiment

    copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    experiment = Path(__file__).parents[1] / "configs/experiments/two_stage_tiny.yaml"
    assert job_working_dir() is None  # outside a job: relative paths are the user's own
    monkeypatch.setenv(JOB_CONFIG_ENV, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_abc.zip"}}))
    assert job_working_dir() == copy
    exp = load_experiment(experiment, ["run_dir=runs/{name}"])
    with pytest.raises(
        ConfigError, match=r"stage pretrain: run_dir .*_ray_pkg_abc/runs/two_stage_tiny/pretrain"
    ):
        check_not_in_job_copy(exp.stages, job_working_dir())
    check_not_in_job_copy(load_experiment(experiment, [f"run_dir={tmp_path / 'shared'}"]).stages, copy)


def test_preflight_checks_every_local_shard_a_pattern_names_and_no_uri():
    """The per-node check reads what data.train names: each shard of a local brace pattern or `::` list (a
    pattern is no path that exists), and nothing for object storage, which every node reads alike."""
    from cluster.preflight import local_paths as _local

    assert _local("/data/c/train/shard-{000000..000002}.tar") == [
        f"/data/c/train/shard-00000{i}.tar" for i in range(3)
    ]
    assert _local("file:/a.tar::/b.tar") == ["/a.tar", "/b.tar"]
    assert _local("/data/corpus") == ["/data/corpus"]
    assert _local("s3://bucket/corpus?endpoint_override=x") == [] and _local(None) == []


def test_shard_as_a_job_refuses_paths_the_job_would_resolve_in_its_copy(tmp_path, monkeypatch):
    """`vitpipe shard ... --ray --address http://...` runs in the job's copy of this directory: a relative
    output would be written there (and deleted with it), a relative input the upload leaves out (data/, or
    outside the project) is not there. Both are refused, named, before the cluster is contacted; an
    uploaded relative input, object storage and absolute paths pass on to the token check."""

    def no_client(address):
        raise AssertionError("contacted the cluster")

    monkeypatch.setattr(submit, "client", no_client)
    monkeypatch.chdir(Path(__file__).parents[1])
    monkeypatch.setenv("HOME", str(tmp_path))  # no token here: what passes the path checks stops there
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    url = "http://127.0.0.1:8265"
    with pytest.raises(submit.SubmitError, match=r"OUT 'out/mine': relative, so it would be written inside"):
        submit.submit_shard([], {"OUT": "out/mine"}, {}, url, "python")
    with pytest.raises(
        submit.SubmitError,
        match=r"FILE 'data/m.csv', --labels '../l.csv': relative and not uploaded.*s3://BUCKET",
    ):
        submit.submit_shard(
            [], {"OUT": "s3://b/d"}, {"FILE": "data/m.csv", "--labels": "../l.csv"}, url, "python"
        )
    for inputs in (
        {"FILE": "configs/experiments/smoke.yaml"},
        {"DIR": "/shared/images"},
        {"DIR": "s3://b/i"},
    ):
        with pytest.raises(submit.SubmitError, match="no Ray auth token"):
            submit.submit_shard([], {"OUT": "/shared/data/mine"}, inputs, url, "python")
    assert submit.is_jobs_api(url) and submit.is_jobs_api("https://ray.example.com")
    assert not any(map(submit.is_jobs_api, ("127.0.0.1:6379", "ray://head:10001", "auto", None)))


def test_a_relative_dataset_path_is_refused_before_any_upload():
    """data.train by a relative path would be looked for inside the job's copy of the working directory
    (which leaves out data/, on the head node only): refused, naming the setting each stage reads it from."""
    root = Path(__file__).parents[1]
    two_stage = str(root / "configs/experiments/two_stage_tiny.yaml")  # defaults.data.train: data/smoke
    with pytest.raises(
        submit.SubmitError,
        match=r"defaults.data.train 'data/smoke': relative.*s3://BUCKET/data/NAME.*/shared/data",
    ):
        submit.check_datasets_written(two_stage, [])
    for fine in ("/shared/data/smoke", "s3://bucket/smoke", "pipe:cat /x.tar"):
        submit.check_datasets_written(two_stage, [f"defaults.data.train={fine}"])
    # A dropped stage reads nothing: the relative default is read by no stage that runs.
    submit.check_datasets_written(two_stage, ["stages.pretrain.data.train=/d/smoke", "stages.finetune=null"])
    demo = str(root / "configs/experiments/demo.yaml")  # each stage its own; the demo gives them absolute
    with pytest.raises(
        submit.SubmitError, match=r"^\S+demo.yaml: stages.finetune.data.train 'data/demo/digits'"
    ):
        submit.check_datasets_written(demo, ["stages.pretrain.data.train=/d/synthetic"])
    absolute = [f"stages.{s}.data.train=/d/digits" for s in ("finetune", "eval_finetune", "finetune_scratch")]
    submit.check_datasets_written(
        demo, [*absolute, "stages.pretrain.data.train=/d/s", "stages.eval_scratch.data.train=/d"]
    )
    single = str(root / "configs/experiments/smoke.yaml")
    with pytest.raises(submit.SubmitError, match=r"data.train 'data/smoke': relative"):
        submit.check_datasets_written(single, [])
