"""``gradsift bench compress``: compressor overhead, measured beside the memory floor and a bare ``torch.topk``.

For every gradient size and target density, the DDP hook's encode and decode of each
compressor are timed side by side with one read pass over the gradient and a bare
``torch.topk``, on a heavy-tailed synthetic gradient. One job per module:

* :mod:`.config` -- what a run measures (:class:`CompressBenchConfig`, :data:`DTYPES`);
* :mod:`.synthetic` -- the input (:func:`synthetic_gradient`, :data:`INPUT_DESCRIPTION`);
* :mod:`.hook_encoder` -- what ``compress`` and ``decompress`` time: the hook's own
  calls, its step closed untimed (:class:`HookEncoder`);
* :mod:`.timing` -- the protocol: warm-up, interleaved rounds, medians, device
  synchronisation (:func:`interleaved_medians_ms`, :func:`in_rotation`);
* :mod:`.groups` -- which methods are timed together, in which groups
  (:func:`benchmarkable`, :func:`density_option`), and their raw samples;
* :mod:`.contended` -- ``processes > 1``: the same measurement in concurrent processes,
  failing fast when one dies (:func:`exit_status`);
* :mod:`.rows` -- the result: one row per compressor and group (:func:`run_compress_benchmark`);
* :mod:`.table` -- the printed table (:func:`format_table`).
"""

from gradsift.tools.benchmarking.config import DTYPES, CompressBenchConfig
from gradsift.tools.benchmarking.contended import exit_status
from gradsift.tools.benchmarking.groups import benchmarkable, density_option
from gradsift.tools.benchmarking.hook_encoder import HookEncoder
from gradsift.tools.benchmarking.rows import run_compress_benchmark
from gradsift.tools.benchmarking.synthetic import INPUT_DESCRIPTION, synthetic_gradient
from gradsift.tools.benchmarking.table import format_table
from gradsift.tools.benchmarking.timing import in_rotation, interleaved_medians_ms

__all__ = [
    "DTYPES",
    "INPUT_DESCRIPTION",
    "CompressBenchConfig",
    "HookEncoder",
    "benchmarkable",
    "density_option",
    "exit_status",
    "format_table",
    "in_rotation",
    "interleaved_medians_ms",
    "run_compress_benchmark",
    "synthetic_gradient",
]
