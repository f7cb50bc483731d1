"""The notebooks in colabs/ run end to end at their small size, and say what they should.

Each notebook has a cell tagged `parameters`; the test replaces its source with the small-size values
(and a workdir under pytest's tmp path), executes every cell with nbclient in a fresh kernel from the
repository root, and reads the executed outputs back.
"""

import json
import pathlib

import pytest

from jaxflow.config import load_config

pytestmark = pytest.mark.slow  # executes the notebooks end to end

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[2]
COLABS = ROOT / "colabs"


def copy_small_base(shared_base, into: pathlib.Path) -> None:
    """The base of quickstart's and staleness_lab's SMALL size, which is the `small` option's (a 30-step warm
    start on 400 examples: the job tests' base), copied into the notebook's base folder before it runs: its
    warm-start cell finds it built for its settings instead of building it again. Should the notebooks'
    settings change, the cell rebuilds it: slower, never wrong."""
    shared_base(load_config(str(ROOT / "configs" / "arithmetic_tiny.py") + ":async,small"), into)


def execute(name: str, parameters: str, timeout: int = 900):
    """The notebook `name` executed with its parameters cell's source replaced by `parameters`."""
    nb = nbformat.read(COLABS / name, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"{name} needs exactly one cell tagged 'parameters', has {len(tagged)}"
    tagged[0].source = parameters
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return nb


def outputs(nb, output_type: str):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == output_type]


def text_of(nb) -> str:
    return "".join(o.get("text", "") for o in outputs(nb, "stream"))


def test_committed_notebooks_carry_no_outputs():
    for path in sorted(COLABS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.get("outputs") and cell.get("execution_count") is None, \
                    f"{path.name} is committed with outputs; strip them"


def test_quickstart_trains_async_and_sync_plots_and_generates_from_the_export(tmp_path, shared_base):
    copy_small_base(shared_base, tmp_path / "runs" / "base")
    nb = execute("quickstart.ipynb", f"SMALL = True\nWORKDIR = {str(tmp_path / 'runs')!r}\nSTEPS = 4\n")
    lines = [ln for ln in text_of(nb).splitlines() if ln.startswith("QUICKSTART_SUMMARY ")]
    assert len(lines) == 1, text_of(nb)[-3000:]
    summary = json.loads(lines[0].split(" ", 1)[1])
    assert summary["eta"] == {"async": 4, "sync": 0}
    for name in ("async", "sync"):
        assert 0.0 <= summary["final_accuracy"][name] <= 1.0
        accounting = summary["accounting"][name]
        assert accounting["consumed"] == 4 * 2 and accounting["ledger_groups"] == 4 * 2
        assert accounting["ledger_duplicates"] == 0
        assert (tmp_path / "runs" / name / "export" / "model.safetensors").is_file()
    assert summary["max_staleness"]["sync"] == 0
    assert 0 <= summary["max_staleness"]["async"] <= 4
    # The exported policy, reloaded, answers greedily as the run's own final eval did.
    assert summary["export_accuracy"] == pytest.approx(summary["final_accuracy"]["async"], abs=1 / 16 + 1e-9)
    assert summary["export_answer"].strip()
    # The figure (accuracy, reward, staleness) is rendered inline.
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 1
    assert (tmp_path / "runs" / "base" / "base_info.json").is_file()


def test_your_model_and_data_survives_a_buggy_reward_then_trains_exports_and_matches_transformers(tmp_path):
    workdir = tmp_path / "yours"
    nb = execute("your_model_and_data.ipynb",
                 f"SMALL = True\nWORKDIR = {str(workdir)!r}\nSTEPS = 3\nMODEL_ID = 'Qwen/Qwen3-0.6B'\n")
    text = text_of(nb)
    lines = [ln for ln in text.splitlines() if ln.startswith("YOURDATA_SUMMARY ")]
    assert len(lines) == 1, text[-3000:]
    summary = json.loads(lines[0].split(" ", 1)[1])
    # The kernel survived the buggy reward: every cell ran, the last one included.
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    # The buggy reward's error is shown in its own cell, once, and its failed samples are in the accounting.
    buggy = [c for c in nb.cells if c.cell_type == "code" and "rl.run(buggy_config)" in c.source]
    assert len(buggy) == 1
    err = "".join(o.get("text", "") for o in buggy[0].get("outputs", [])
                  if o.get("output_type") == "stream" and o.get("name") == "stderr")
    assert err.count("jaxflow: reward function buggy_reward:reward raised AttributeError: 'NoneType' object "
                     "has no attribute 'group'; the sample scores 0 and the run goes on") == 1, err
    a = summary["buggy_accounting"]
    assert a["reward_raised"] > 0 and a["reward_calls"] >= a["reward_scored"] + a["reward_raised"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert a["ledger_duplicates"] == 0 and summary["buggy_exit"] in (0, 2)
    # The model directory was used as given (no warm-start cache file written into it).
    assert f"jaxflow: base model {workdir / 'my_model'}: an HF model the warm start did not build" in text
    assert not (workdir / "my_model" / "base_info.json").exists()
    # The fixed reward trained every step on groups it scored, none failing.
    a = summary["accounting"]
    assert a["consumed"] == a["ledger_groups"] == 3 * 2 and a["ledger_duplicates"] == 0
    assert a["reward_raised"] == a["reward_invalid"] == 0 and a["reward_scored"] > 0
    for key in ("base_accuracy", "final_accuracy", "export_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    # transformers reloads the export, and its logits match jaxflow's within float32 rounding.
    assert (workdir / "runs" / "mine" / "export" / "model.safetensors").is_file()
    assert 0.0 <= summary["logits_max_diff"] <= summary["logits_bound"] < 1e-3
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 1
    # The LoRA section: the adapters alone trained, PEFT's adapter over the base gives the merged export's logits.
    assert 0 < summary["lora_trained_params"] < summary["full_trained_params"] / 5
    assert 0.0 <= summary["lora_final_accuracy"] <= 1.0
    assert (workdir / "runs" / "lora" / "adapter" / "adapter_model.safetensors").is_file()
    assert 0.0 <= summary["lora_logits_max_diff"] <= summary["lora_logits_bound"] < 1e-3


def test_staleness_lab_sweeps_the_losses_and_simulates_against_the_tail_floor(tmp_path, shared_base):
    copy_small_base(shared_base, tmp_path / "runs" / "base")
    # 7 simulated steps (2 measured after the first eta + 1): the simulator is deterministic for a seed, and at 7
    # steps jaxflow makes 1.14x AReaL-style's tokens/s (10 steps: 1.11x), synchronous 0.25x, every mean step
    # >= 1.13x its floor; 10 steps cost 31 CPU-s here, 7 steps 20. 64 instances only: 512 take 4 more minutes.
    nb = execute("staleness_lab.ipynb", f"SMALL = True\nWORKDIR = {str(tmp_path / 'runs')!r}\nETAS = (4,)\n"
                 "STEPS = 4\nSIM_STEPS = 7\nSIM_SIZES = (64,)\n")
    lines = [ln for ln in text_of(nb).splitlines() if ln.startswith("LAB_SUMMARY ")]
    assert len(lines) == 1, text_of(nb)[-3000:]
    summary = json.loads(lines[0].split(" ", 1)[1])
    assert summary["etas"] == [0, 4] and summary["steps"] == 4
    # eta = 0 once (the three losses coincide there), every loss at eta = 4: the table has every cell.
    runs = summary["runs"]
    assert set(runs) == {"decoupled_ppo_eta0", "ppo_eta4", "decoupled_ppo_eta4", "tis_eta4"}
    for name, r in runs.items():
        accounting = r["accounting"]
        assert accounting["consumed"] == 4 * 2 and accounting["ledger_groups"] == 4 * 2, (name, accounting)
        assert accounting["ledger_duplicates"] == 0
        assert accounting["created"] == (accounting["consumed"] + accounting["in_flight"]
                                         + accounting["failed"] + accounting["surplus"]), (name, accounting)
        assert 0 <= r["max_staleness"] <= r["eta"], name
        assert 0.0 <= r["base_accuracy"] <= 1.0 and 0.0 <= r["final_accuracy"] <= 1.0, name
        assert 0.0 <= r["clip_frac"] <= 1.0 and 0.0 <= r["behav_capped_frac"] <= 1.0, name
        assert r["behav_weight_max"] > 0.0 and r["approx_kl"] >= 0.0 and r["wall_s"] > 0.0, name
    assert runs["decoupled_ppo_eta0"]["max_staleness"] == 0
    # One minibatch per step: decoupled PPO's gradient is taken at pi_theta = pi_prox, where its clip
    # cannot act; PPO reports no behaviour weight (1).
    assert runs["decoupled_ppo_eta0"]["clip_frac"] == 0.0 and runs["decoupled_ppo_eta4"]["clip_frac"] == 0.0
    assert runs["ppo_eta4"]["behav_weight_max"] == 1.0
    sim = summary["sim"]
    assert set(sim) == {f"64/{s}" for s in ("synchronous", "AReaL-style", "jaxflow")}
    for n in (64,):
        # jaxflow's strategies vs AReaL-style: about equal on this tail-bound preset (the README's figures:
        # 0.94-1.12x), and one workload seed over a few steps moves a run by about 10%.
        assert sim[f"{n}/jaxflow"]["tokens_per_s"] >= 0.9 * sim[f"{n}/AReaL-style"]["tokens_per_s"], sim
        assert sim[f"{n}/synchronous"]["tokens_per_s"] < sim[f"{n}/AReaL-style"]["tokens_per_s"], sim
        for s in ("synchronous", "AReaL-style", "jaxflow"):
            r = sim[f"{n}/{s}"]
            assert r["groups_surplus"] == 0, r
            # Every sample trained: no step below the tail floor, but for the floor's own draw noise.
            assert r["step_s_mean"] >= 0.9 * r["floor_step_s"], r
    assert sim["64/synchronous"]["eta"] == 0 and sim["64/jaxflow"]["eta"] == 4
    # Both figures (the sweep's curves and mechanisms, the simulated steps against the floor) are inline.
    images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) == 2
    assert (tmp_path / "runs" / "base" / "base_info.json").is_file()


def test_the_readme_links_every_notebook_to_colab_and_its_install_cell_clones_the_same_repository():
    readme = (ROOT / "README.md").read_text()
    for path in sorted(COLABS.glob("*.ipynb")):
        link = f"https://colab.research.google.com/github/jaxflow/jaxflow/blob/main/colabs/{path.name}"
        assert link in readme, f"README has no Open-in-Colab link for {path.name}"
        nb = nbformat.read(path, as_version=4)
        install = [c.source for c in nb.cells if c.cell_type == "code" and "google.colab" in c.source]
        assert len(install) == 1 and 'JAXFLOW_GIT = "https://github.com/jaxflow/jaxflow.git"' in install[0], \
            f"{path.name}: its Colab-only install cell should clone the repository the README links to"


def test_tools_notebook_runs_calculator_episodes_and_shows_them(tmp_path):
    nb = execute("tools.ipynb", f"SMALL = True\nWORKDIR = {str(tmp_path / 'runs')!r}\nSTEPS = 3\nLATENCY_S = 0.05\n")
    lines = [ln for ln in text_of(nb).splitlines() if ln.startswith("TOOLS_SUMMARY ")]
    assert len(lines) == 1, text_of(nb)[-3000:]
    summary = json.loads(lines[0].split(" ", 1)[1])
    assert summary["steps"] == 3 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert 0.0 <= summary["env_frac_first"] <= 1.0 and all(f is not None for f in summary["eval_env_frac"])
    # Every shown episode was scored by the calculator environment (its reward, not None).
    assert len(summary["episode_rewards"]) == 3 and all(r in (0.0, 1.0) for r in summary["episode_rewards"])
    assert outputs(nb, "display_data"), "the curves were not drawn"
    assert "--- Compute" in text_of(nb)
