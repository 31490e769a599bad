"""The line `streamrl run` ends with: the success rate of the run's first steps against its last."""

from __future__ import annotations

from pipelines.tracking.progress import summary_window


def test_the_run_summary_compares_windows_that_do_not_overlap():
    assert [summary_window(steps) for steps in (1, 2, 3, 16, 19, 20, 24, 500)] == [1, 1, 1, 8, 9, 10, 10, 10]
    for steps in range(2, 60):  # the first and the last window never share a step
        assert 2 * summary_window(steps) <= steps
