"""Suite hooks: slow subprocess tests start in the background when collection ends and run last
(tests/helpers_background.py says why). A test module opts in with
`BACKGROUND = {"test_name": start_function}`."""
import helpers_background


def _starter(item):
    hooks = getattr(getattr(item, "module", None), "BACKGROUND", {})  # non-Python items: none
    return hooks.get(getattr(item, "originalname", item.name))


def pytest_collection_modifyitems(session, config, items):
    """Background tests go last, so their commands have the whole suite's time to finish."""
    items.sort(key=lambda item: _starter(item) is not None)  # stable: order kept otherwise


def pytest_collection_finish(session):
    for start in dict.fromkeys(s for s in map(_starter, session.items) if s is not None):
        start()


def pytest_sessionfinish(session, exitstatus):
    helpers_background.stop_all()
