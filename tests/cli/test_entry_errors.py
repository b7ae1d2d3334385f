"""Bad configs at the entry points: exit code 2, one `config error: ...` line naming the key, no traceback.

Each run sets JAX_PLATFORMS to a platform that does not exist, so any device initialization would
crash with a traceback: a clean exit 2 shows the config was rejected before any JAX work.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflop_jax.config import ConfigError, load_config
from dflop_jax.runtime.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def run_entry(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "no_such_platform", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, key, fix",
    [
        (["model.num_heads=3"], "model.num_heads=3", "multiple of model.num_kv_heads=2"),
        (["data.source=no/such/data.json"], "data.source='no/such/data.json'", "file not found"),
        (["plan=no/such/plan.yaml"], "plan='no/such/plan.yaml'", "file not found"),
        (["data.tokenizer=no/such/dir"], "data.tokenizer='no/such/dir'", "directory not found"),
        (["plan=explicit", "layout.llm_tp=3"], "layout.llm_tp=(3,)", "model.num_heads=4"),
        (["steps=ten"], "steps: expected an integer", ""),
    ],
)
def test_train_rejects_bad_configs_in_one_line(args, key, fix):
    out = run_entry("dflop_jax.train", *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), out.stderr
    assert key in lines[0] and fix in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.hf_dir=no/such/dir"],
            "model.hf_dir='no/such/dir': directory not found; give an HF",
        ),
        (["model.num_kv_heads=0"], "model.num_kv_heads=0: must be >= 1"),
        (
            ["plan=auto", "model.kind=decoder", "layout.encoder_layers=[]"],
            "plan='auto': plan=auto profiles models with an encoder",
        ),
        (["model.head_dim=15"], "model.head_dim=15: must be even (RoPE)"),
        (["model.num_layers=3"], "layout.llm_layers=(2, 2): must add up to model.num_layers=3"),
        (
            ["model.kind=decoder"],
            "layout.encoder_layers=(1, 1): model.kind=decoder has no vision encoder",
        ),
        (
            ["layout.lengths=[512,256]"],
            "layout.lengths=(512, 256): give >= 1 bucket size, increasing",
        ),
        (["layout.tiles=[0,4]"], "layout.tiles=(0, 4): bucket sizes must be >= 1"),
        (["layout.microbatches=[4,2]"], "layout.microbatches=(4, 2): need 1 <= min <= max"),
        (["layout.encoder_tp=[1,1,1]"], "layout.encoder_tp=(1, 1, 1): give one value or one per"),
        (["data.chat_template=from_tokenizer"], "data.chat_template='from_tokenizer': the bundled"),
        (["data.image_root=no/such/dir"], "data.image_root='no/such/dir': directory not found"),
        (["optimizer.b2=1.0"], "optimizer.b2=1.0: must be in [0, 1)"),
        (["seed=-1"], "seed=-1: use a seed in 0 .. 2**32-1"),
    ],
)
def test_train_config_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, overrides)
    assert message in str(e.value)


def test_nested_configs_name_the_full_key():
    with pytest.raises(ConfigError, match=r"^planner\.seed=-1: use a seed"):
        load_config(TrainConfig, None, ["planner.seed=-1"])
    with pytest.raises(ConfigError, match=r"^profile\.data_samples=0: must be >= 1"):
        load_config(TrainConfig, None, ["profile.data_samples=0"])


@pytest.mark.parametrize(
    "command",
    [("dflop_jax.plan", "--no-progress"), ("dflop_jax.profile", "data"),
     ("dflop_jax.profile", "model"), ("dflop_jax.profile", "auto")],
)  # fmt: skip
def test_plan_and_profile_reject_a_missing_shape_file_in_one_line(command):
    out = run_entry(*command, "profile.data_source=no/such/shapes.json")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "config error: profile.data_source='no/such/shapes.json': file not found; give a "
        "shape-distribution JSON, 'dataset' or one of ('llava-ov', 'omnibal')"
    ]


def test_keys_the_mode_ignores_are_reported_in_one_warning(caplog):
    demo = REPO / "configs" / "demo.yaml"  # plan: auto
    with caplog.at_level(logging.WARNING, logger="dflop_jax.config.parsing"):
        load_config(TrainConfig, demo, ["layout.llm_tp=[2]", "layout.tiles=[8]", "steps=3"])
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("ignored config keys layout.llm_tp, layout.tiles (layout: read only")
    assert "steps" not in message.split("(")[0]


def test_planner_and_profile_keys_are_read_whatever_the_plan(caplog):
    """`python -m dflop_jax.plan` and `... profile` read them from the same run config."""
    with caplog.at_level(logging.WARNING, logger="dflop_jax.config.parsing"):
        load_config(TrainConfig, None, ["plan=explicit", "planner.samples=3", "profile.runs=2"])
    assert not caplog.records


def test_used_keys_are_not_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="dflop_jax.config.parsing"):
        load_config(TrainConfig, REPO / "configs" / "demo.yaml", ["planner.samples=3"])
    assert caplog.records == []


@pytest.fixture(scope="module")
def tiny_plans(tmp_path_factory):
    """plan.yaml files with separate encoder stages and with the encoder colocated (at the stage's tp,
    as the trainer's planner plans it): the runtime trains both."""
    from dflop_jax.planner import PlannerConfig, make_plan, save_plan
    from dflop_jax.scheduler import llava_ov_mix

    out, shapes = tmp_path_factory.mktemp("plans"), llava_ov_mix(100, 0)
    paths = {}
    for colocate in (False, True):
        cfg = PlannerConfig(global_batch=8, microbatches=(2, 4), samples=1, screen_top=1,
                            llm_pp=(1,), colocate=colocate, colocate_own_tp=False)  # fmt: skip
        plan = make_plan("tiny", "cpu", 4, shapes, cfg)
        assert bool(plan.layout.encoder_stages) != colocate
        paths[colocate] = save_plan(plan, out / f"colocate_{colocate}.yaml")
    return paths


def test_a_plan_file_the_runtime_cannot_train_is_a_load_error(tiny_plans, tmp_path):
    assert load_config(TrainConfig, None, [f"plan={tiny_plans[False]}"]).plan == str(
        tiny_plans[False]
    )
    assert load_config(TrainConfig, None, [f"plan={tiny_plans[True]}"]).plan == str(
        tiny_plans[True]
    )
    # a colocated encoder at its own tp below the stage's: the runtime does not run it
    own_tp = tmp_path / "own_tp.yaml"
    text = tiny_plans[True].read_text().replace("tp: 1", "tp: 2")
    own_tp.write_text(text + "encoder_colocated_tp: 1\n")
    with pytest.raises(ConfigError, match=r"plan='.*own_tp.yaml': .*its own tp=1"):
        load_config(TrainConfig, None, [f"plan={own_tp}"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("{}\n")
    out = run_entry("dflop_jax.train", f"plan={broken}")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: plan="), out.stderr
    assert "not a dflop plan" in lines[0] and "Traceback" not in out.stderr


def test_inputs_that_exist_pass_and_a_dir_missing_its_file_is_named(tiny_plans, tmp_path):
    plan, data, tok = tiny_plans[False], tmp_path / "d.jsonl", tmp_path / "tok"
    data.write_text("")
    tok.mkdir()
    over = [f"plan={plan}", f"data.source={data}"]
    assert load_config(TrainConfig, None, over).plan == str(plan)
    with pytest.raises(
        ConfigError, match=r"data\.tokenizer='.*tok': no tokenizer\.json in it; give"
    ):
        load_config(TrainConfig, None, [*over, f"data.tokenizer={tok}"])
    (tok / "tokenizer.json").write_text("{}")
    assert load_config(TrainConfig, None, [*over, f"data.tokenizer={tok}"]).data.tokenizer == str(
        tok
    )


def test_a_decoder_reports_its_vision_keys_as_ignored(caplog):
    over = ["model.kind=decoder", "layout.encoder_layers=[]", "model.vision_num_layers=3"]
    with caplog.at_level(logging.WARNING, logger="dflop_jax.config.parsing"):
        load_config(TrainConfig, None, over)
    (record,) = caplog.records
    assert record.getMessage().startswith("ignored config keys model.vision_num_layers (")


def test_a_global_batch_larger_than_the_usable_data_is_one_line(tmp_path, capsys):
    """Records left after the bad ones are skipped and after the eval hold-out: fewer than
    global_batch is one `config error: global_batch=...` line (exit 2), before any param is made."""
    import json

    from models_fixtures import tiny_decoder_run

    from dflop_jax import train
    from dflop_jax.data import load_source
    from dflop_jax.data.config import DataConfig
    from dflop_jax.data.split import split_records

    lines = [json.dumps({"id": f"t{i}", "text": f"plain text number {i}"}) for i in range(10)]
    lines += [
        "{not json",
        json.dumps({"id": "empty", "text": ""}),
    ]  # invalid_json, no_conversations
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    kept, held = split_records(load_source(DataConfig(source=str(data))), 0.25, 0)
    usable = sum(str(r.get("id", "")).startswith("t") for r in kept)
    bad = len(kept) - usable
    assert held and bad  # this split exercises both
    over = {"data.source": str(data), "eval.fraction": 0.25, "eval.every": 2, "global_batch": 12,
            "plan": "explicit"}  # fmt: skip
    assert train.main(tiny_decoder_run(tmp_path, "run", 8, **over)) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("config error")]
    assert line.startswith(
        f"config error: global_batch=12: the data has {usable} usable record(s), fewer than one "
        f"global batch ({len(kept)} records; {bad} skipped ("
    ), line
    assert f"{len(held)} more held out by eval.fraction=0.25); set global_batch={usable} or" in line
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()
