"""Helpers shared by the tests, imported by name (`from helpers.search import synthetic_profile`; tests/conftest.py
puts tests/ on sys.path): search.py, synthetic profiles and clusters (no torch work); runtime.py, tiny model options,
plan files and the single-process references; async_reference.py, the version-by-version reference of the
asynchronous schedules; post_validate_ranks.py, the rank side of test_post_validate's direct runs; fuzz_cases.py,
the CLI fuzz corpus. Model files that tests hand to pipeplan by path (`file.py:function`) stay beside their tests."""
