"""Suite-wide: the durations file. With ``ZEROSHARD_TEST_DURATIONS`` set to a path (``.ci/run`` sets it), the run
writes every test's seconds there at its end (setup, call and teardown together; a module's shared spawn counts in
the first test that asks for it), slowest first, so a regression shows against the last run's file."""

import os
from collections import defaultdict

SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("ZEROSHARD_TEST_DURATIONS")
    if not path or not SECONDS:
        return
    lines = [f"{seconds:9.2f}  {nodeid}" for nodeid, seconds in sorted(SECONDS.items(), key=lambda kv: -kv[1])]
    with open(path, "w") as f:
        f.write(f"{sum(SECONDS.values()):9.2f}  total over {len(SECONDS)} tests\n" + "\n".join(lines) + "\n")
