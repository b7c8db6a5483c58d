"""The monitor blocks: a missing package is a clear error naming the block and the fix."""

import sys

import pytest

from zeroshard.config import parse_config
from zeroshard.runtime.monitor import Monitors


@pytest.mark.parametrize("block,package", [("wandb", "wandb"), ("comet", "comet_ml")])
def test_an_enabled_monitor_without_its_package_is_a_clear_error(monkeypatch, block, package):
    monkeypatch.setitem(sys.modules, package, None)  # what `import` sees where the package is not installed
    config = parse_config({"train_batch_size": 2, block: {"enabled": True}})
    with pytest.raises(ImportError, match=rf"config block '{block}' is enabled but the {package} package is missing"):
        Monitors(config, rank=0)
    assert Monitors(config, rank=1).sinks == []  # only rank 0 writes: the others never import it
