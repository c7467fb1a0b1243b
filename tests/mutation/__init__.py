"""The mutation harness: each synchronization's mutant, and the runner that shows a test
catches it (``python -m tests.mutation.run``; see ``tests/mutation/README.md``)."""
