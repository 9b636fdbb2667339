"""Every process a job launches is named once, in elasticdl.common.entry_points, by a module
that has a main()."""

import importlib

from elasticdl.common import entry_points


def test_each_entry_point_names_a_module_with_main():
    for entry in entry_points.ALL:
        module = importlib.import_module(entry.module)
        assert callable(getattr(module, "main", None)), entry
        assert entry.argv("py") == ["py", "-m", entry.module]
        assert entry.module.split(".")[1] == entry.name   # elasticdl.<name>.main
