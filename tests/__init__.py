"""The test suite is a package (every folder has an `__init__.py`), so pytest imports each test file
under its dotted name (`tests.model.test_model`) with the repository root on `sys.path`: test files
of the same name in different folders never clash, and helpers are imported by full path
(`from tests.hf_fixtures import ...`). Folders mirror the rooms of docs/architecture.md."""
