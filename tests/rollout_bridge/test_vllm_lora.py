"""vLLM's own LoRA interface against jaxflow, on CPU: adapters jaxflow wrote in PEFT's format, loaded by
vLLM over the base model (one adapter per version, requests on the newest), sample the tokens and
log-probs of jaxflow's forward with the same adapters (fp32, within 1e-4).

vLLM runs in a process of its own (vllm_lora_server.py). Skipped when vLLM is not importable, except
under CI, where vLLM must run.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from engine_helpers import adapted, lively_tiny_model, prompts, require_vllm, teacher_forced

require_vllm("the vLLM LoRA test")

from jaxflow.models import hf_io, lora  # noqa: E402
from jaxflow.models.lora import LoRASpec  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes

SPEC = LoRASpec(rank=8, alpha=16.0)
ATOL = 1e-4  # fp32 on both sides: vLLM's CPU kernels and XLA's differ only in summation order


def test_vllm_serves_jaxflows_peft_adapters_version_after_version(tmp_path):
    base = lively_tiny_model(tmp_path / "base")
    models = [adapted(base, SPEC, seed) for seed in (1, 2)]
    dirs = [lora.write_adapter(tmp_path / f"v{i + 1}", SPEC, lora.peft_tensors(m.layers), base_model=str(base))
            for i, m in enumerate(models)]
    asked = prompts(seed=3, lens=(3, 9, 20))
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("vllm_lora_server.py")), str(base),
                           str(SPEC.rank), json.dumps(asked), *map(str, dirs)],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_LORA ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr[-3000:]
    served = json.loads(lines[0].split(" ", 1)[1])
    base_model = hf_io.load_model(base)
    for model, answers in zip(models, served, strict=True):
        for prompt, answer in zip(asked, answers, strict=True):
            logp, argmax = teacher_forced(model, prompt, answer["tokens"], pad_to=64)
            assert answer["tokens"] == argmax.tolist()  # greedy under the adapters
            np.testing.assert_allclose(answer["logprobs"], logp, atol=ATOL, rtol=0)
            # ...and not under the base alone: the adapters were applied.
            base_logp, _ = teacher_forced(base_model, prompt, answer["tokens"], pad_to=64)
            assert np.abs(np.asarray(base_logp) - logp).max() > 10 * ATOL
    assert served[0] != served[1]  # the second version's adapter, not the first's
