"""Settings every test file shares."""


def pytest_collection_modifyitems(config, items):
    """Files holding slow tests first, each file's tests in their order: ``make test`` runs two files at a
    time, and the long ones (engines, trainers) started early keep both workers busy to the end instead of
    leaving one running alone (the Makefile keeps this order: ``--no-loadscope-reorder``)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
