"""kmp.engine: the flat-buffer training engine and kmp.prepare's fit().

    buffers.py         the flat buffers: one variable per dtype for weights, gradients and slots
    layout.py          how the replicas hold and step them (whole, in shards, one copy), chosen once
    rules.py           the optimizers' update rules on flat buffers
    fused.py           the fused per-variable update
    zero.py            ZeRO stage 1: optimizer state placed on host or sharded
    replica_state.py   per-replica values in checkpoints
    wall_clock.py      the step clock (overflow timing)
    engine.py          Engine: when buffers are copied around fit()'s callbacks
    replica_step.py    the per-replica XLA train step prepare() installs
    xla_choice.py      whether a forward/backward's trace is worth XLA's compile
    iterators.py       finished input iterators destroyed off the main thread
    overflow_layer.py  find_overflow: which layer's forward output overflowed
    forward_overflow.py  a layer's float16 output not finite: raised, or the layer moved to float32
    lower_precision.py the layers a config's torch_autocast block does not mark safe, moved to float32
    prepare.py         prepare(model): fit() under strategies (kmp.prepare)
    state.py           the one object kmp keeps on a model: prepare's settings, the caches above

May import kmp.scaling, kmp.distribute, kmp.memory.estimate, kmp.config and
the leaves; never kmp.callbacks or kmp.cli. Private: users reach it through
kmp.prepare and kmp.find_overflow. This file imports nothing.
"""
