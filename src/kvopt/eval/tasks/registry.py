"""The task registry (name -> task object) and score dispatch."""

from __future__ import annotations

from kvopt.eval.tasks.base import Sample, Task, TaskError
from kvopt.eval.tasks.conversation import LongConversation
from kvopt.eval.tasks.niah import MagicNumbers, Needle
from kvopt.eval.tasks.passkey import Passkey
from kvopt.eval.tasks.prose import ProseMultiKey, ProseNeedle
from kvopt.eval.tasks.retrieval import Retrieval
from kvopt.eval.tasks.ruler import CommonWords, FrequentWords, VariableTracking

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Passkey(),
        Needle(),
        MagicNumbers("niah_multikey", keys=4, values=1, queries=1),
        MagicNumbers("niah_multivalue", keys=1, values=4, queries=1),
        MagicNumbers("niah_multiquery", keys=4, values=1, queries=4),
        ProseNeedle(),
        ProseMultiKey(),
        VariableTracking(),
        CommonWords(),
        FrequentWords(),
        *(Retrieval(name, passages=4, hops=hops) for name, hops in (("retrieval", 1), ("retrieval_2hop", 2))),
        LongConversation(),
    )
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")
    return TASKS[name]


def score(sample: Sample, prediction: str) -> float:
    """The sample's task score of ``prediction``, in [0, 1]."""
    return get_task(sample.task).score(sample, prediction)
