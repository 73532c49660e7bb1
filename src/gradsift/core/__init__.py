"""The trip's vocabulary, below everything else: payloads and their wire framing, a
bucket's parts and context and the one outcome of a trip, the state store and the one
transaction of a step, the step's readout, telemetry, collectives, errors and validation.
Imports nothing of gradsift above it.
"""
