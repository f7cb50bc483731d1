"""Tests of jaxflow.jobs.run_log: metrics.jsonl, TensorBoard events, console lines, plots and resume."""

import json
import struct

import pytest

from jaxflow.jobs.run_log import RunLog, read_records

pytestmark = pytest.mark.slow  # TensorBoard and matplotlib plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Scalar events in a TensorBoard log directory: tag -> [(step, value)], read without tensorboard.

    An event file is a sequence of records: u64 length, u32 length-crc, payload, u32 payload-crc.
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _log_run(workdir, steps, **kwargs) -> RunLog:
    """A RunLog with `steps` train steps logged (reward 0.1*step, staleness 0/1) and one eval."""
    run = RunLog(workdir, total_steps=10, **kwargs)
    for step in steps:
        run.log_step(step, {"reward_mean": 0.1 * step, "loss": 0.012, "trained_tokens_per_s": 5100.0,
                            "custom_metric": 7.0}, staleness={0: 70, 1: 30})
    run.log_eval(steps[-1], 0.5, n=20)
    return run


def test_log_step_writes_jsonl_tb_console_and_plots(tmp_path, capsys):
    run = _log_run(tmp_path, [0, 1, 2])
    plots = run.close()

    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 2]
    assert records[1]["reward_mean"] == pytest.approx(0.1)
    assert records[1]["custom_metric"] == 7.0
    assert records[1]["staleness"] == {"0": 70, "1": 30}
    eval_record = {k: v for k, v in records[-1].items() if k != "time_s"}  # times: checked below
    assert eval_record == {"step": 2, "eval_accuracy": 0.5, "eval_n": 20.0}
    times = [r["time_s"] for r in records]
    assert times == sorted(times) and times[0] >= 0
    assert run.staleness_total == {0: 210, 1: 90}

    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert scalars["custom_metric"][0] == (0, 7.0)
    assert scalars["eval_accuracy"] == [(2, 0.5)]
    assert scalars["staleness_mean"][0] == (0, pytest.approx(0.3))

    lines = capsys.readouterr().out.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 3
    assert step_lines[1].startswith("step 1/10 | reward 0.1 | acc - | loss 0.012 | tok/s 5.1k")
    assert "stale 0:70% 1:30%" in step_lines[1]
    assert "custom_metric" not in step_lines[1]
    assert any(line.startswith("eval step 2 | accuracy 0.5") for line in lines)

    assert sorted(p.name for p in plots) == ["reward.png", "staleness.png"]
    for p in plots:
        assert p.parent == tmp_path / "plots"
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_resume_drops_redone_steps_and_continues_time(tmp_path, capsys):
    _log_run(tmp_path, [0, 1, 2, 3]).close()
    before = read_records(tmp_path / "metrics.jsonl")
    last_time = max(r["time_s"] for r in before)

    run = RunLog(tmp_path, total_steps=10, start_step=2, resume=True)
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [0, 1]
    assert run.staleness_total == {0: 140, 1: 60}
    run.log_step(2, {"reward_mean": 0.9})
    run.close()

    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["reward_mean"] == 0.9
    assert records[2]["time_s"] >= last_time
    assert "step 2/10 | reward 0.9" in capsys.readouterr().out


def test_quiet_prints_nothing(tmp_path, capsys):
    _log_run(tmp_path, [0, 1], quiet=True).close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert len(read_records(tmp_path / "metrics.jsonl")) == 3


def test_existing_metrics_without_resume_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "time_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl"):
        RunLog(tmp_path, total_steps=10)


def test_reserved_metric_name_is_an_error(tmp_path):
    with RunLog(tmp_path, total_steps=1, quiet=True) as run, pytest.raises(ValueError, match="time_s"):
        run.log_step(0, {"time_s": 1.0})
