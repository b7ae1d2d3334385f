"""`train plan=<plan.yaml>` refuses, in one line, a plan made for another model, recipe, devices or
global batch, and notes a plan made from other data than the run's profile."""

import dataclasses

import pytest

from dflop_jax.config import ConfigError
from dflop_jax.contracts.files import file_hash
from dflop_jax.costs import get_arch, get_device
from dflop_jax.planner import make_plan, save_plan
from dflop_jax.planner.config import PlannerConfig
from dflop_jax.planner.resolve import check_plan_fits_run, plan_data_note
from dflop_jax.scheduler import llava_ov_mix

TRAINABLE_PARTS = ("vision", "projector", "llm")  # local copy: tests state the recipe by value


@pytest.fixture(scope="module")
def plan():
    space = PlannerConfig(tp=(1,), encoder_pp=(1,), llm_pp=(1, 2), microbatches=(2,),
                          num_buckets=(2,), samples=1, global_batch=8, screen_top=2, top_n=0)  # fmt: skip
    return make_plan("tiny", "cpu", 4, llava_ov_mix(64, 0), space)


def test_the_run_the_plan_was_made_for_passes(plan):
    check_plan_fits_run(plan, "p.yaml", get_arch("tiny"), get_device("cpu"), 4, TRAINABLE_PARTS, 8)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_devices": 8}, "4 devices (this run has 8)"),
        ({"device": get_device("h100")}, "device 'cpu' (this run's is 'h100')"),
        ({"trainable": ("projector",)}, "recipe trainable=['vision', 'projector', 'llm']"),
        ({"arch": get_arch("siglip-so400m+qwen2.5-0.5b")}, "model 'tiny' (this run's has"),
        (
            {"global_batch": 16},
            "global_batch=8 (this run's is 16): re-plan for this run (python "
            "-m dflop_jax.plan) or use plan=auto, or set global_batch=8",
        ),
    ],
)
def test_a_plan_for_another_run_is_one_config_error(plan, change, message):
    run = {"arch": get_arch("tiny"), "device": get_device("cpu"), "num_devices": 4,
           "trainable": TRAINABLE_PARTS, "global_batch": 8} | change  # fmt: skip
    with pytest.raises(ConfigError) as e:
        check_plan_fits_run(plan, "p.yaml", run["arch"], run["device"], run["num_devices"],
                            run["trainable"], run["global_batch"])  # fmt: skip
    assert str(e.value).startswith("plan=p.yaml was made for ") and message in str(e.value)
    assert "\n" not in str(e.value)
    assert ("set global_batch=" in str(e.value)) == ("global_batch" in change)


def test_train_refuses_a_plan_for_another_global_batch(plan, tmp_path, capsys):
    """`train plan=...` with the run's global_batch other than the plan's: one line, exit 2."""
    from dflop_jax import train

    path = save_plan(plan, tmp_path / "plan.yaml")
    over = ["model.arch=tiny", "device=cpu", "num_devices=4", f"plan={path}", "global_batch=16",
            f"run_dir={tmp_path / 'run'}", "compilation_cache="]  # fmt: skip
    assert train.main(over) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("config error")]
    assert line == (
        f"config error: plan={path} was made for global_batch=8 (this run's is 16): re-plan for "
        "this run (python -m dflop_jax.plan) or use plan=auto, or set global_batch=8"
    )


def test_a_plan_made_from_other_shapes_than_the_runs_profile_is_noted(plan, tmp_path):
    shapes = tmp_path / "auto_plan" / "data" / "shape_distribution.json"
    made = dataclasses.replace(
        plan, inputs={"shapes": {"path": str(shapes), "sha256": "0" * 64}, "cost_table": "analytic"}
    )
    assert plan_data_note(made, "p.yaml", shapes) == ""  # no profile in the run: nothing to compare
    shapes.parent.mkdir(parents=True)
    shapes.write_text('{"samples": []}')
    note = plan_data_note(made, "p.yaml", shapes)
    assert note.startswith(f"plan=p.yaml was made from the shape distribution {shapes} (sha256 "
                           f"000000000000), but this run's {shapes} differs (sha256 ")  # fmt: skip
    assert note.endswith("re-plan (python -m dflop_jax.plan) to plan for it") and "\n" not in note
    same = dataclasses.replace(made, inputs={"shapes": {"path": "x", "sha256": file_hash(shapes)}})
    assert plan_data_note(same, "p.yaml", shapes) == ""
    assert plan_data_note(dataclasses.replace(made, inputs={}), "p.yaml", shapes) == ""


def test_same_layers_other_widths_is_another_model(plan):
    tiny = get_arch("tiny")
    wider = dataclasses.replace(tiny, llm=dataclasses.replace(tiny.llm, hidden_size=128))
    with pytest.raises(ConfigError, match="model 'tiny'"):
        check_plan_fits_run(plan, "p.yaml", wider, get_device("cpu"), 4, TRAINABLE_PARTS, 8)


def test_train_refuses_a_plan_cli_plan_for_other_devices_in_one_line(tmp_path):
    """The commands as a user runs them: `plan` for 4 devices, then `train` of the same run config on
    2 devices with that plan.yaml: one `config error:` line, exit 2, nothing trained."""
    import subprocess
    import sys
    from pathlib import Path

    from multiprocess_launch import own_devices_env

    from dflop_jax import plan as plan_cli

    root = Path(__file__).resolve().parents[2]
    config = ["--config", str(root / "configs" / "plan_tiny_cpu.yaml"), "planner.samples=1",
              f"data.synth_dir={tmp_path / 'synth'}", "data.synth_samples=16"]  # fmt: skip
    made = tmp_path / "made"
    assert plan_cli.main(["--no-progress", *config, "num_devices=4", f"run_dir={made}"]) == 0
    env = own_devices_env()  # the run asks for its 2 devices, as a user's would (not the suite's 8)
    out = subprocess.run(
        [sys.executable, "-m", "dflop_jax.train", *config, "num_devices=2", "steps=1",
         f"run_dir={tmp_path / 'run'}", f"plan={made / 'plan.yaml'}"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"config error: plan={made / 'plan.yaml'} was made for 4 devices (this "
                           "run has 2)"), line  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()
