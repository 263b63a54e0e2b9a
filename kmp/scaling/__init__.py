"""kmp.scaling: dynamic loss scaling and the optimizer that applies it.

    state.py       the scale's update rule, pure (no TensorFlow)
    overflow.py    the overflow check, and LossScaleError with its diagnosis
    gradients.py   finite checks, unscaling and clipping of gradients
    accumulate.py  gradient accumulation windows
    optimizer.py   LossScaleOptimizer
    wrap.py        kmp.wrap: a Keras optimizer (or a DeepSpeed config) to kmp's
    quantize.py    block-wise 8-bit quantization
    eight_bit.py   Adam8bit, AdamW8bit

May import kmp.config, kmp.distribute, kmp.precision and the leaves;
optimizer.py also uses the engine's fused update, ZeRO placement, per-replica
state and wall clock (kmp.engine's modules that import no kmp.scaling.optimizer).
This file imports nothing.
"""
