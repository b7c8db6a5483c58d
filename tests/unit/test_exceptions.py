"""Every exception zeroshard raises survives a round trip through pickle, as a harness that runs ranks in a
``multiprocessing.Pool`` (DeepSpeed's tests) sends a rank's exception back to its parent. One that did not
(``StageAborted``, whose ``__init__`` takes the failed rank) ended the pool's result thread when unpickled, and the
parent then waited for ever: DeepSpeed's ``TestPipeDynamicShape`` hung at PP=2 x DP=2."""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import pickle
import pkgutil

import pytest

import zeroshard

# the classes whose __init__ takes more than a message, with arguments to build one
ARGUMENTS = {"StageAborted": ("rank 2 (pipeline stage 1): stopped: rank 0 failed", 0, 1)}


def _exception_classes() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages(zeroshard.__path__, "zeroshard."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("zeroshard"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[name] for name in sorted(found)]


CLASSES = _exception_classes()


def test_the_scan_finds_the_exceptions():
    names = {c.__name__ for c in CLASSES}
    assert {"StageAborted", "PipelineError", "ConfigError", "ShardedParameterError", "CollectiveError"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_exception_round_trips_through_pickle(cls):
    if "__init__" in cls.__dict__:
        assert cls.__name__ in ARGUMENTS, f"{cls.__name__} has its own __init__: add its arguments to ARGUMENTS"
    error = cls(*ARGUMENTS.get(cls.__name__, ("something failed",)))
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error) and vars(back) == vars(error)


def _raise(index: int):
    from zeroshard.pipe import StageAborted

    raise StageAborted(f"rank {index}: stopped: rank 0 failed", 0, source=index - 1)


def test_a_pool_gets_a_ranks_stage_aborted_back():
    """What DeepSpeed's harness does with a failed test: ``starmap_async(...).get()`` in the parent."""
    from zeroshard.pipe import StageAborted

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pending = pool.starmap_async(_raise, [(1,), (2,)])
        with pytest.raises(StageAborted, match="stopped: rank 0 failed") as caught:
            pending.get(120)
    assert caught.value.origin == 0 and caught.value.source in (0, 1)
