"""What the tests share: the launcher of gloo workers, the models and samples they train and
compare, the packaged-install and documented-command machinery, and the repository's root.

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml), so a test imports
``support.<module>``; the processes the launcher starts get the same path
(:func:`support.distributed.with_test_path`).
"""

from pathlib import Path

#: The repository's root: the folder of pyproject.toml, src/, docs/, examples/.
ROOT = Path(__file__).resolve().parents[2]
