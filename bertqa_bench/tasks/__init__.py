"""Tasks as packages: ``tasks/squad`` (SQuAD v1.1 EM/F1) and ``tasks/nq`` (Natural Questions).

The registry maps a task name to its class by import path, so importing this package imports
no task (and no task imports another).
"""
from __future__ import annotations

import importlib

from ..errors import ConfigError
from .base import Task

TASKS = {
    "squad": "bertqa_bench.tasks.squad.task:SquadTask",
    "nq": "bertqa_bench.tasks.nq.task:NQTask",
}


def get_task(name: str) -> Task:
    try:
        target = TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task '{name}'; tasks: {', '.join(TASKS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["TASKS", "Task", "get_task"]
