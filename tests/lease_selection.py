"""A pytest plugin for tests/test_gpu_session.py: with ``--co -k EXPR`` over a lease's test files,
it writes to $LEASE_REPORT which collected tests skip here for want of CUDA (a ``skipif`` whose
condition holds and whose reason names CUDA or a GPU) and which of those ``-k`` deselects: tests
a lease's selection would never run. Not part of the suite."""
import json
import os

import pytest

_waiting: list[str] = []
_deselected: set[str] = set()


def _waits_for_cuda(item) -> bool:
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
        reason = mark.kwargs.get("reason", "")
        if condition is True and ("CUDA" in reason or "GPU" in reason):
            return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    _waiting.extend(item.nodeid for item in items if _waits_for_cuda(item))


def pytest_deselected(items):
    _deselected.update(item.nodeid for item in items)


def pytest_collection_finish(session):
    with open(os.environ["LEASE_REPORT"], "w") as f:
        json.dump({"waiting": _waiting, "waiting_deselected": [n for n in _waiting if n in _deselected]}, f)
