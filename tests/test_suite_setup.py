"""The suite's own machinery, as the README's test command runs it."""

import pytest


@pytest.mark.xdist_group("suite_setup")
def test_the_tests_of_a_group_are_scheduled_as_one(request):
    """`--dist loadgroup` (setup.cfg) sends the tests of one xdist_group to one worker, which then
    computes what they share once: the real-model matrix's groups, the multi-worker runs.

    pytest-xdist marks a group by an "@group" suffix on each test's node id. A pytest that drops
    the suffix (9.2) makes every worker that gets one of a group's tests compute the whole group.
    """
    if not hasattr(request.config, "workerinput") or not request.config.getvalue("loadgroup"):
        pytest.skip("run without `--dist loadgroup` workers: nothing is scheduled by group")
    assert request.node.nodeid.endswith("@suite_setup"), request.node.nodeid
