"""A curated mutation check: safety-critical behaviour broken on purpose, one way at a time.

Run ``python -m tests.mutation`` (``.ci/run`` does). Each mutation in
:mod:`tests.mutation.catalog` is applied to a temporary copy of the repository and the tests
that must catch it are run against that copy; a mutation the tests do not catch (they pass)
fails the check. The last line reads ``mutations: K of N killed``.
"""
