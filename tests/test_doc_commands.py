"""Every command the README and docs/ show is run by a test, or is marked with what it needs that CI lacks.

A command is a line of a ```bash block in README.md or docs/*.md (a line ending in a backslash continues on
the next); commands joined by `&&` are checked part by part. A block right after a comment
`<!-- needs: WHAT -->` needs WHAT (GPUs, a multi-node cluster, software installed elsewhere) and is exempt.

Every other command is in COMMANDS, which names the evidence that a test runs it: (file, text) pairs, each
saying that the file (a test, or what a test executes) contains the text, the command's distinctive parts
(its config, its script, its key flags). Benchmark commands are parsed with the benchmark's own arguments by
tests/test_benchmark_commands.py. Besides, every `jaxflow.main` command shown, marked or not, must load:
its config file, variant and overrides name real keys with values of the right type.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOTEBOOKS = "tests/colabs/test_notebooks.py"
COMMANDS: dict[str, tuple[tuple[str, str], ...]] = {
    # The set-up script: CI runs it before the suite.
    "python3 -m jaxflow.setup_env": ((".ci/run", "python3 -m jaxflow.setup_env"),),
    "python3 -m jaxflow.setup_env --no-vllm": (("tests/test_setup_env.py", '"--no-vllm"'),),
    # The suite itself: CI's command.
    ".venv/bin/python -m pytest -q -n 2": ((".ci/run", ".venv/bin/python -m pytest -q -n 2"),),
    ".venv/bin/lint-imports": (("tests/test_layers.py", '"lint-imports"'),),
    ".venv/bin/ruff check .": (("tests/test_lint.py", '_ruff(".")'),),
    ".venv/bin/mkdocs build --strict -f docs/mkdocs/mkdocs.yml -d build/site": (
        ("tests/test_docs_site.py", '"--strict"'), ("tests/test_docs_site.py", '"mkdocs" / "mkdocs.yml"')),
    # The main job: the tools notebook runs its config, at a small size.
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_tools_tiny.py": (
        (NOTEBOOKS, '"tools.ipynb"'), ("colabs/tools.ipynb", "configs/arithmetic_tools_tiny.py")),
    # The calculator task as an agent program: the agent job test runs its config, at a small size.
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_agent_tiny.py": (
        ("tests/jobs/test_agent_job.py", '"configs/arithmetic_agent_tiny.py:async,small"'),),
    # The calculator task as a verifiers environment: the adapter's tests run its config, at a small size.
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_verifiers_tiny.py": (
        ("tests/envs/test_verifiers_adapter.py", '"configs/arithmetic_verifiers_tiny.py:async,small"'),),
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_tools_tiny.py --config.trainer.lora.rank=8 "
    "--config.trainer.lr=1e-3": (
        ("tests/jobs/test_lora_job.py", '"trainer.lora.rank": "8"'), ("tests/jobs/test_lora_job.py", '"trainer.lr"')),
    ".venv/bin/python -m jaxflow.main --config=configs/jsonl_qa_tiny.py --config.task.path=data/train.jsonl "
    "--config.base.dir=path/to/hf_model --config.task.reward_ref=my_reward:reward": (
        ("tests/jobs/test_user_model_and_reward.py", "--config=configs/jsonl_qa_tiny.py"),
        ("tests/jobs/test_user_model_and_reward.py", "task.reward_ref"),
        ("tests/jobs/test_user_model_and_reward.py", "base.dir")),
    ".venv/bin/python -m jaxflow.main --config=configs/tiny_model.py:llama --config.model.num_layers=4": (
        ("tests/test_main.py", '"tiny_model.py"'), ("tests/test_main.py", ':llama"'),
        ("tests/test_main.py", '"model.num_layers"')),
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py --config.cluster.mode=ray": (
        ("tests/small_runs.py", 'CONFIG = "configs/arithmetic_tiny.py"'), ("tests/jobs/test_rl_job.py", 'mode="ray"')),
    ".venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py --config.cluster.mode=ray "
    "--config.cluster.rollout_actors=2 --config.cluster.trainer_processes=2 --config.cluster.trainer_cpu_devices=4 "
    "--config.cluster.trainer_mesh.fsdp=4 --config.cluster.trainer_mesh.tensor=2": (
        ("tests/small_runs.py", 'CONFIG = "configs/arithmetic_tiny.py"'),
        ("tests/cluster/test_ray_rl.py", "small_config("),
        ("tests/cluster/test_ray_rl.py", ('"cluster.mode": "ray", "cluster.rollout_actors": 2, '
                                          '"cluster.trainer_processes": 2')),
        ("tests/cluster/test_ray_rl.py", ('"cluster.trainer_cpu_devices": 4, "cluster.trainer_mesh.fsdp": 4, '
                                          '"cluster.trainer_mesh.tensor": 2'))),
    ".venv/bin/python -m jaxflow.jobs.rollout_worker --trajectories HOST:PORT --params HOST:PORT --model DIR": (
        ("tests/jobs/test_rollout_worker_args.py", '"--trajectories"'),
        ("tests/jobs/test_rollout_worker_args.py", '"--params"'),
        ("tests/jobs/test_rollout_worker_args.py", '"--model"'),
        ("tests/coordination/test_one_engine.py", "jaxflow.jobs.rollout_worker")),
}
# The fast tier arrives with the `slow` marker; pytest -m selects by a marker registered in pyproject.toml.
FAST_TIER = '.venv/bin/python -m pytest -q -n 2 -m "not slow"'
BENCHMARK = re.compile(r"^\.venv/bin/python benchmarks/(\w+)\.py\b")
BENCHMARK_ARGS_TEST = ROOT / "tests" / "test_benchmark_commands.py"


def _commands(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """(command, what it needs or None) for each command of a ```bash block of `path`."""
    found, needs, lines = [], None, path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if m := re.fullmatch(r"<!-- needs: (.+?) -->", line):
            needs = m.group(1)
        elif line == "```bash":
            i += 1
            command = ""
            while lines[i].strip() != "```":
                part = lines[i].strip()
                command += part[:-1].rstrip() + " " if part.endswith("\\") else part
                if not part.endswith("\\"):
                    if command and not command.startswith("#"):
                        found.append((command, needs))
                    command = ""
                i += 1
            needs = None
        elif line:
            needs = None
        i += 1
    return found


def _parts(command: str) -> list[str]:
    return [p.strip() for p in command.split("&&")]


ALL = [(path.relative_to(ROOT).as_posix(), c, n) for path in DOCS for c, n in _commands(path)]
CHECKED = sorted({part for _, c, n in ALL if n is None for part in _parts(c)})


FENCE_LANGUAGES = ("bash", "python", "text", "json")
COMMAND_START = re.compile(r"^(python3? |\.venv/bin/|benchmarks/\w+\.py|mkdocs |ray |pip |RAY_\w+=)")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_sit_only_in_bash_blocks(path):
    """Every fenced block names its language, and only ```bash blocks hold commands, so the scan above
    sees every command."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)
    untagged = [body.splitlines()[0] if body else "" for lang, body in blocks if lang not in FENCE_LANGUAGES]
    assert not untagged, f"blocks without one of the languages {FENCE_LANGUAGES}: {untagged}"
    hidden = [line for lang, body in blocks if lang != "bash" for line in body.splitlines()
              if COMMAND_START.match(line.strip())]
    assert not hidden, f"commands outside ```bash blocks, which the command check does not see: {hidden}"


def test_the_docs_show_commands():
    assert len(ALL) >= 10 and any(n for _, _, n in ALL), "the command scan found too little: is its rule broken?"
    assert "python3 -m jaxflow.setup_env" in CHECKED


@pytest.mark.parametrize("command", [c for c in CHECKED if c != FAST_TIER and not BENCHMARK.match(c)])
def test_every_command_is_run_by_a_test(command):
    assert command in COMMANDS, (f"{command!r} is shown in the docs but no test is known to run it: add it to "
                                 f"COMMANDS with the test that runs it, or mark its block <!-- needs: ... -->")
    for file, text in COMMANDS[command]:
        assert text in (ROOT / file).read_text(), f"{file} does not contain {text!r}, so it does not run {command!r}"


def test_no_command_in_the_table_is_stale():
    stale = sorted(set(COMMANDS) - set(CHECKED))
    assert not stale, f"COMMANDS lists commands the docs no longer show: {stale}"


def test_benchmark_commands_name_real_scripts_and_are_parsed_by_their_test():
    commands = [c for c in CHECKED if BENCHMARK.match(c)]
    assert commands, "docs/benchmarks.md shows no benchmark command"
    missing = sorted(c for c in commands if not (ROOT / "benchmarks" / f"{BENCHMARK.match(c).group(1)}.py").is_file())
    assert not missing, f"commands of scripts that do not exist: {missing}"
    outside = sorted(c for path, c, _ in ALL if BENCHMARK.match(c) and path != "docs/benchmarks.md")
    assert not outside, ("benchmark commands belong in docs/benchmarks.md, where their argument check reads "
                         f"them: {outside}")
    if not BENCHMARK_ARGS_TEST.exists():
        pytest.skip("tests/test_benchmark_commands.py (the benchmarks' argument check) is not in this tree")
    assert "benchmarks.md" in BENCHMARK_ARGS_TEST.read_text(), \
        "tests/test_benchmark_commands.py does not read the commands of docs/benchmarks.md"


def test_the_fast_tier_selects_by_a_registered_marker():
    assert FAST_TIER in CHECKED, "the README no longer shows the fast tier"
    import tomllib
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = [m.split(":")[0].strip() for m in pytest_options.get("markers", [])]
    if not markers:
        pytest.skip("no pytest markers are registered in this tree yet (the `slow` marker comes with the fast tier)")
    assert "slow" in markers, f"the fast tier deselects `slow`, but pyproject.toml registers only {markers}"


MAIN = [c for _, command, _ in ALL for c in _parts(command) if " -m jaxflow.main " in c]


@pytest.mark.parametrize("command", MAIN)
def test_every_main_command_loads_its_config(command, monkeypatch):
    from jaxflow.config import load_config
    from jaxflow.main import parse_args

    monkeypatch.chdir(ROOT)
    spec, overrides = parse_args(command.split(" -m jaxflow.main ", 1)[1].split())
    load_config(spec, overrides)
