"""zeroshard's logger: what prints, at which level, and bad levels named."""

import logging

import pytest

from zeroshard import log


@pytest.fixture
def library_logger():
    logger = logging.getLogger("zeroshard")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers[:] = [h for h in handlers if isinstance(h, logging.NullHandler)]  # as after import
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def test_log_to_stdout_prints_rank0_lines_once_and_changes_only_the_level_again(library_logger, capsys):
    log.log_to_stdout()
    log.log_to_stdout("warning")
    log.log_rank0("hidden at warning")
    log.log_to_stdout(logging.INFO)
    log.log_rank0("shown")
    assert capsys.readouterr().out == "[zeroshard] shown\n"  # one stdout handler, not three
    assert library_logger.propagate is False


@pytest.mark.parametrize("level", ["verbose", "", "INFO; rm -rf /", "nan", "-1"])
def test_a_bad_level_is_named(library_logger, level):
    with pytest.raises(ValueError, match="log level .* is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        log.log_to_stdout(level)


def test_the_launchers_variable_configures_output_only_when_set(library_logger, monkeypatch, capsys):
    monkeypatch.delenv(log.LEVEL_VARIABLE, raising=False)
    log.log_as_launched()
    assert not any(type(h).__name__ == "_CurrentStdout" for h in library_logger.handlers)
    monkeypatch.setenv(log.LEVEL_VARIABLE, "bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        log.log_as_launched()
    monkeypatch.setenv(log.LEVEL_VARIABLE, "debug")
    log.log_as_launched()
    assert library_logger.level == logging.DEBUG
