"""Weight EMA (`optim.ema_decay`, pipeline.train.ema): each rank keeps the EMA of its own share of the weights
beside the real DeepSpeed engine's fp32 masters, for every ZeRO stage, in fp32 and bf16; a checkpoint's EMA
loads on any world size and ZeRO stage; the export writes it beside the weights.

Through the training loop: resumed EMA == uninterrupted EMA (tests/test_training.py), the EMA resharded at a
resume on another world size (tests/test_world_size.py), the EMA in object storage (tests/test_storage.py),
and an eval stage's eval_ema/* metrics (tests/test_eval_stage.py).

    .venv/bin/python -m pytest tests/test_ema.py -q
"""

import json
import math

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file

from pipeline.config import ConfigError, load_config
from pipeline.exported import EMA_WEIGHTS, META, WEIGHTS, ema_weights, load_exported
from pipeline.models import create_model
from pipeline.train.ema import Fragment, WeightEma, flat_share, reading_order
from pipeline.train.export import export_weights

SCRIPT = "tests/scripts/ema.py"
SMOKE = "configs/experiments/smoke.yaml"
STAGES = ("0", "1", "2", "3")


@pytest.mark.unit
def test_ema_decay_is_a_fraction_and_off_by_default():
    assert load_config(SMOKE).optim.ema_decay is None
    assert load_config(SMOKE, ["optim.ema_decay=0.99996"]).optim.ema_decay == 0.99996
    for bad in ("1.0", "0", "-0.5"):
        with pytest.raises(ConfigError, match="optim.ema_decay"):
            load_config(SMOKE, [f"optim.ema_decay={bad}"])


@pytest.mark.unit
def test_the_export_writes_the_ema_beside_the_weights_and_a_later_export_without_one_removes_it(tmp_path):
    kwargs = {"img_size": 32, "num_classes": 4}
    model = create_model("vit_debug", **kwargs)
    state = model.state_dict()
    ema = {k: v + 1.0 for k, v in model.named_parameters()}  # buffers (none here) would come from `state`
    out = tmp_path / "export"
    export_weights(
        state, "vit_debug", kwargs, out, step=7, ema={k: v.detach() for k, v in ema.items()}, ema_decay=0.9
    )
    meta = json.loads((out / META).read_text())
    assert meta["ema"] == {"weights": EMA_WEIGHTS, "decay": 0.9}
    raw, averaged = load_file(str(out / WEIGHTS)), load_file(str(out / EMA_WEIGHTS))
    assert raw.keys() == averaged.keys()
    assert all(torch.equal(averaged[k], raw[k] + 1.0) for k in raw)
    # Found from the folder or its weights file, and loadable as any export (with the folder's model.json).
    assert ema_weights(out) == ema_weights(out / WEIGHTS) == str(out / EMA_WEIGHTS)
    assert ema_weights(out / EMA_WEIGHTS) is None  # it is the EMA already
    loaded, loaded_meta = load_exported(out / EMA_WEIGHTS)
    assert all(torch.equal(loaded[k], averaged[k]) for k in raw) and loaded_meta["step"] == 7
    # A re-export without an EMA leaves none behind to be taken for this export's.
    export_weights(state, "vit_debug", kwargs, out, step=8)
    assert not (out / EMA_WEIGHTS).exists() and "ema" not in json.loads((out / META).read_text())
    assert ema_weights(out) is None


@pytest.mark.dist
def test_each_rank_keeps_its_share_and_the_ema_is_the_whole_model_one_then_reloads_on_another_world(tmp_path):
    """2 ranks, ZeRO 0-3, fp32 and bf16: the assembled EMA equals a reference lerped over the whole consolidated
    weights after each step, bit for bit; each rank held about half of it; loaded by 3 ranks under another
    ZeRO stage (uneven shares), it is the same again. A tag missing a rank's file is refused, naming what is
    missing. (A load on 1 rank, through the loop: tests/test_world_size.py.)"""
    load_ranks = 3
    torchrun(SCRIPT, "save", str(tmp_path), "fp32,bf16", *STAGES)
    torchrun(SCRIPT, "load", str(tmp_path), "fp32,bf16", *STAGES, nproc=load_ranks)
    for precision in ("fp32", "bf16"):
        root = tmp_path / precision
        for stage in STAGES:
            report = json.loads((root / f"zero{stage}" / "report.json").read_text())
            assert report["params"] > 20 and report["differ"] == [], (precision, stage, report["differ"])
            owned = sum(report["owned"])  # rank 0's share
            assert 0.4 * report["elements"] < owned < 0.6 * report["elements"], (precision, stage, owned)
            # Decay 0.5 over 4 steps: the EMA trails the weights, by less than the weights moved.
            assert 0 < report["from_weights"] < report["moved"], (precision, stage, report)
            loaded = json.loads((root / f"zero{stage}" / f"loaded_on_{load_ranks}.json").read_text())
            assert loaded["differ"] == [], f"{precision} ZeRO-{stage} -> {(int(stage) + 1) % 4}: {loaded}"
        missing = json.loads((root / "zero0" / f"loaded_on_{load_ranks}.json").read_text())["without_rank_1"]
        assert "partial_" in missing and "the EMA files of 2 saved ranks (1 here) lack" in missing
        assert (
            f"elements of rank {load_ranks - 1}'s share" in missing
        )  # the last rank's share lay in rank 1's


def _zero3(params, rank: int, world: int) -> list[Fragment]:
    """ZeRO-3's partition (part `rank` of `world` equal parts of every parameter, the last one short)."""
    out = []
    for name, shape in params:
        numel = math.prod(shape)
        size = -(-numel // world)
        if rank * size < numel:
            out.append(Fragment(name, rank * size, min((rank + 1) * size, numel), numel))
    return out


def _flat(params, rank: int, world: int) -> list[Fragment]:
    return flat_share([(n, math.prod(s)) for n, s in params], rank, world)


def _whole(params, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(math.prod(s), generator=g) for n, s in params}


@pytest.mark.unit
@pytest.mark.parametrize(
    "saved_layout, loaded_layout, new_world, most_files",
    [
        (_zero3, _zero3, 12, 3),  # ZeRO-3 on 16 -> 12: the owners under ZeRO-3's cut, seen in the first file
        (_flat, _flat, 12, 2),  # ZeRO-0 on 16 -> 12: the ranks at the same place
        (_zero3, _zero3, 16, 1),  # the same world: its own file
        (_flat, _zero3, 12, 16),  # another ZeRO stage: right, whatever it opens
        (_zero3, _flat, 5, 16),
    ],
)
def test_a_saved_ema_loads_on_another_layout_reading_only_the_share_from_few_files(
    tmp_path, saved_layout, loaded_layout, new_world, most_files
):
    """Single process, no engine: 16 saved shares of a model with parameters of very different sizes (a bias
    of 5 elements is held by 5 of 16 ranks under ZeRO-3), then every rank of the new world loads its own."""
    params = [("a", (7, 33)), ("b", (5,)), ("c", (40, 16)), ("d", (1,)), ("e", (300,))]
    truth = _whole(params, seed=0)
    for rank in range(16):
        frags = saved_layout(params, rank, 16)
        pairs = [(f, truth[f.name][f.start : f.stop].clone()) for f in frags]
        WeightEma(pairs, params, 0.9, rank, 16).save(tmp_path)
    for rank in range(new_world):
        frags = loaded_layout(params, rank, new_world)
        pairs = [(f, torch.zeros(f.stop - f.start)) for f in frags]
        ema = WeightEma(pairs, params, 0.9, rank, new_world)
        assert ema.load(tmp_path)
        for f, values in zip(ema.fragments, ema.ema):
            assert torch.equal(values, truth[f.name][f.start : f.stop]), (rank, f)
        share = sum(f.stop - f.start for f in frags)
        assert ema.last_load["elements_read"] == share and ema.last_load["files_opened"] <= most_files, (
            rank,
            ema.last_load,
        )


@pytest.mark.unit
def test_reading_order_starts_where_the_share_lay_and_names_every_saved_rank():
    assert reading_order(5, 16, 16)[0] == 5
    assert reading_order(300, 512, 1024)[:2] == [600, 601]  # half the ranks: two saved shares each
    assert reading_order(3, 4, 3)[:1] == [2]
    for rank, world, saved in ((0, 3, 7), (6, 7, 3), (511, 512, 1024)):
        assert sorted(reading_order(rank, world, saved)) == list(range(saved))


@pytest.mark.unit
def test_an_ema_of_another_model_is_refused_naming_the_file_and_parameter(tmp_path):
    params = [("a", (4, 4))]
    WeightEma([(Fragment("a", 0, 16, 16), torch.ones(16))], params, 0.9, 0, 1).save(tmp_path)
    other = WeightEma([(Fragment("a", 0, 8, 8), torch.ones(8))], [("a", (8,))], 0.9, 0, 1)
    with pytest.raises(
        ValueError,
        match=r"ema_rank_0_fp32.safetensors: EMA of parameter 'a' has 16 elements, "
        r"this model's 8",
    ):
        other.load(tmp_path)
    assert not WeightEma([], params, 0.9, 0, 1).load(tmp_path / "nothing")  # no EMA files: nothing taken
