"""Off the hot path: the command line and its commands, the reference trainer, analysis,
reports, the simulator and the benchmarking helpers.
"""
