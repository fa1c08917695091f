"""Weight EMA (`optim.ema_decay`, pipeline.train.ema): each rank keeps the EMA of its own share of the weights
beside the real DeepSpeed engine's fp32 masters, for every ZeRO stage, in fp32 and bf16; a checkpoint's EMA
loads on any world size and ZeRO stage; the export writes it beside the weights.

Through the training loop: resumed EMA == uninterrupted EMA (tests/test_training.py), the EMA resharded at a
resume on another world size (tests/test_world_size.py), the EMA in object storage (tests/test_storage.py),
and an eval stage's eval_ema/* metrics (tests/test_eval_stage.py).

    .venv/bin/python -m pytest tests/test_ema.py -q
"""

import json

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file

from pipeline.config import ConfigError, load_config
from pipeline.models import create_model
from pipeline.train.export import EMA_WEIGHTS, META, WEIGHTS, ema_weights, export_weights, load_exported

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
@pytest.mark.parametrize("precision, load_ranks", [("fp32", 1), ("bf16", 3)])
def test_each_rank_keeps_its_share_and_the_ema_is_the_whole_model_one_then_reloads_on_another_world(
    tmp_path, precision, load_ranks
):
    """2 ranks, ZeRO 0-3: the assembled EMA equals a reference lerped over the whole consolidated weights after
    each step, bit for bit; each rank held about half of it; loaded by another number of ranks under another
    ZeRO stage, it is the same again. A tag missing a rank's file is refused, naming what is missing."""
    torchrun(SCRIPT, "save", str(tmp_path), precision, *STAGES)
    for stage in STAGES:
        report = json.loads((tmp_path / f"zero{stage}" / "report.json").read_text())
        assert report["params"] > 20 and report["differ"] == [], f"ZeRO-{stage}: {report['differ']}"
        owned = sum(report["owned"])  # rank 0's share
        assert 0.4 * report["elements"] < owned < 0.6 * report["elements"], (stage, owned)
        # Decay 0.5 over 4 steps: the EMA trails the weights, by less than the weights moved.
        assert 0 < report["from_weights"] < report["moved"], (stage, report)
    torchrun(SCRIPT, "load", str(tmp_path), precision, *STAGES, nproc=load_ranks)
    for stage in STAGES:
        loaded = json.loads((tmp_path / f"zero{stage}" / f"loaded_on_{load_ranks}.json").read_text())
        assert loaded["differ"] == [], f"ZeRO-{stage} -> {(int(stage) + 1) % 4} on {load_ranks}: {loaded}"
    missing = json.loads((tmp_path / "zero0" / f"loaded_on_{load_ranks}.json").read_text())
    assert "ema_rank_0_fp32.safetensors" in missing["without_rank_1"]
    assert "lack" in missing["without_rank_1"] and "elements of rank" in missing["without_rank_1"]
