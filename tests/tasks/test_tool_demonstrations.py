"""The calculator demonstrations of the arithmetic tool demo: the tiny tokenizer's extra tokens, which
problems demonstrate the tool, and the warm start's episode records (the tool's answer masked)."""

import asyncio

import pytest

from jaxflow.envs.calculator import CalculatorEnv
from jaxflow.envs.render import ObservationRenderer
from jaxflow.jobs.warm_start import sft_records
from jaxflow.models.tiny import write_tiny_tokenizer
from jaxflow.tasks.arithmetic import ArithmeticTask

MARKERS = ("<tool>", "</tool>", "<result>", "</result>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), 512, extra_tokens=MARKERS)


def test_extra_tokens_are_single_tokens_decoded_as_text(tokenizer, tmp_path):
    plain = write_tiny_tokenizer(tmp_path, 512)
    assert tokenizer.vocab_size == plain.vocab_size + len(MARKERS)
    for marker in MARKERS:
        (token,) = tokenizer.encode(marker)
        assert token >= plain.vocab_size
    text = "I use <tool>7 + 5</tool>\n<result>12</result>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("no markers here 7 + 5") == plain.encode("no markers here 7 + 5")


@pytest.mark.parametrize("extra, match", [(("<|im_end|>",), "other than the special tokens"),
                                          (("a", "a"), "distinct"), (("",), "non-empty")])
def test_bad_extra_tokens_are_refused(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        write_tiny_tokenizer(tmp_path, 512, extra_tokens=extra)


def test_a_fraction_of_problems_demonstrates_the_tool(tokenizer):
    task = ArithmeticTask(max_ops=3, max_number=9, operators="+-*", tool_fraction=0.3)
    examples = task.examples("train", 400, seed=0)
    turns = [task.demonstration_turns(e) for e in examples]
    tool = [t for t in turns if len(t) == 3]
    assert 0.2 < len(tool) / len(turns) < 0.4
    assert ArithmeticTask(tool_fraction=0.3).demonstration_turns(examples[0]) == turns[0]  # stable choice
    assert all(len(t) == 1 for t in (ArithmeticTask(tool_fraction=0.0).demonstration_turns(e) for e in examples))
    records = sft_records(task, examples, tokenizer)
    renderer = ObservationRenderer(tokenizer)
    for record, example, t in zip(records, examples, turns):
        ids, spans = record["completion"], record["env_spans"]
        assert ids[-1] == tokenizer.eos_id
        if len(t) == 1:
            assert spans == [] and ids[:-1] == tokenizer.encode(task.demonstration(example))
            continue
        (a, b), = spans
        # The tool's answer as an RL episode would render it after a turn that stopped at </tool>.
        assert ids[a:b] == renderer.ids(t[1][1], turn_closed=False)
        assert tokenizer.decode(ids[:a]) == f"<tool>{example['expression']}</tool>"
        assert tokenizer.decode(ids[b:-1]) == f"<answer>{example['answer']}</answer>"
        # And the calculator agrees with the demonstration's result.
        env = CalculatorEnv()
        asyncio.run(env.reset(task.meta(example)))
        step = asyncio.run(env.step(tokenizer.decode(ids[:a])))
        assert step.observation == t[1][1]


def test_tool_fraction_is_checked():
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        ArithmeticTask(tool_fraction=1.5)
