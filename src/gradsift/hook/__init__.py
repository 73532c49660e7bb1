"""The bucket's route (:mod:`gradsift.hook.route`) and what it keeps between calls: the
frozen options, the hook's state, the parameter layout, error feedback, the step ledger,
adaptive capacities, and the optimizer takeovers (DGC's recipe, the Adam family).
"""
