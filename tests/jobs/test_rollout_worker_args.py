"""The rollout worker CLI refuses bad engine options before connecting or loading anything."""

import pytest

from jaxflow.jobs.rollout_worker import main

SERVICES = ["--trajectories", "127.0.0.1:1", "--params", "127.0.0.1:2", "--model", "/nonexistent"]


@pytest.mark.parametrize("args, says", [
    (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0, got 0.0"),
    (["--kv-cache-gib", "nan"], "--kv-cache-gib must be > 0, got nan"),
    (["--decode-chunk", "0"], "--decode-chunk must be >= 1, got 0"),
    (["--engine", "sglang"], "argument --engine: invalid choice: 'sglang'"),
])
def test_bad_engine_option_is_named(args, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(SERVICES + args)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err

