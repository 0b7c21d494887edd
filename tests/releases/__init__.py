"""The real-release matrix harness: released vLLM wheels, run here; and docs/versions.md.

- ``sources``: downloads each released wheel once and cuts its decision code out.
- ``selector``: a release's CUDA attention selection, run from its source.
- ``venvs``: overlays of a release's wheel over the project's .venv.
- ``imports``, ``e2e``: ``python -m tests.releases.<name>`` in such an overlay.
- ``table``: ``python -m tests.releases.table docs/versions.md`` (``make test-releases``).

Used by tests/test_dsv4_patch/test_release_*.py and test_selector.py; may import
``dsv4_patch`` and ``tests.support``, never a test module.
"""
