"""Worker process entry point: ``python -m gradsift.tools.train.worker CONFIG_JSON [CONFIG_JSON ...]``.

Runs each config in turn (:func:`gradsift.tools.train.loop.run_in_group`) in one process
group (the first config's device and timeout), with rank and world size from the
environment. On failure it writes the traceback to ``<out>/logs/rank<R>.err`` of the run
that failed (the launcher reports the first failing rank's error from there) and exits
with status 1.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from pathlib import Path

from gradsift.tools.train.config import TrainConfig


def error_file(out: str | Path, rank: int) -> Path:
    """Where rank ``rank`` leaves its traceback."""
    return Path(out) / "logs" / f"rank{rank}.err"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m gradsift.tools.train.worker CONFIG_JSON [CONFIG_JSON ...]", file=sys.stderr)
        return 2
    configs = [TrainConfig.load(Path(path)) for path in argv]
    rank = int(os.environ.get("RANK", "0"))
    config = configs[0]
    try:
        from gradsift.tools.train.loop import process_group, run_in_group

        with process_group(config) as (device, backend):
            for config in configs:
                run_in_group(config, device, backend)
    except BaseException as error:
        path = error_file(config.out, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(error)))
        if isinstance(error, KeyboardInterrupt):
            return 130
        traceback.print_exc()
        return 1
    # The runs are over and their process group destroyed: what is alive now dies with the
    # process, so the interpreter's collections at exit skip it (torch's and its compiler's
    # modules: the largest part of a short run's exit) -- gc.freeze, as in tests/conftest.py.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
