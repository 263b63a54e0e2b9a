"""kmp.memory: how many bytes training takes per replica.

    estimate.py    memory_estimate: the count from a parameter count or a model (no TensorFlow)
    allocation.py  measured_bytes and a built model's settings (imports TensorFlow and the engine)

estimate.py imports only kmp.errors and kmp.values at module level, so
`kmp memory` starts without TensorFlow. This file imports nothing.
"""
