"""Issue 64's API findings: a non-model and bad priorities get one line naming the argument and the fix."""

import math

import numpy as np
import pytest
from tiny_models import tiny_model

import kvopt
from kvopt.engine import LLM, SamplingParams
from kvopt.engine.config import EngineConfigError
from kvopt.engine.requests import RequestSchemaError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model", [42, 3.5, [1, 2], {"name": "x"}, object()], ids=["int", "float", "list", "dict", "object"])
def test_a_model_that_is_not_one_is_named(model):
    with pytest.raises(EngineConfigError, match=r"^model=.* is not a model; give a name or path") as error:
        kvopt.LLM(model=model, kv_memory="4MB")
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model("llama"), kv_memory="4MB")


@pytest.mark.parametrize("priority, message", [
    (["x", "y"], r"priority\[0\] is 'x'; give an integer"),
    ([math.nan, 0], r"priority\[0\] is nan; give an integer"),
    ([0, 1.5], r"priority\[1\] is 1.5; give an integer"),
    ([True, 0], r"priority\[0\] is True; give an integer"),
    ("xy", r"priority must be a list of integers, one per prompt; got 'xy'"),
    (7, r"priority must be a list of integers"),
    ([0], r"got 1 priorities for 2 prompts"),
])  # fmt: skip
def test_bad_priorities_are_refused_before_anything_runs(llm, priority, message):
    with pytest.raises(RequestSchemaError, match=message) as error:
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), use_tqdm=False, priority=priority)
    assert error.value.param == "priority" and "\n" not in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_integer_priorities_of_any_integer_type_run(llm):
    outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                           priority=[np.int64(1), 0])  # fmt: skip
    assert [len(output.outputs[0].token_ids) for output in outputs] == [2, 2]
