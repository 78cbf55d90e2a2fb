# tb2_tasks/*/tests/test_outputs.py are the tasks' own verifier tests (run inside a container by
# tests/test.sh), not tests of this repository.
collect_ignore = ["tb2_tasks"]
