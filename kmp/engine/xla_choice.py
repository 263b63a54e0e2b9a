"""Whether kmp's forward/backward is compiled with XLA, by the compile time its traced graph predicts.

XLA:CPU's compile time grows with a graph's ops times its average width
(its ops over its longest path): hundreds of parallel branches compile
for longer than they train, while as many ops stacked 2 wide, as real
models are, compile in a time about linear in their ops, which a model of
that size pays anyway (benchmarks/RESULTS.md, P5). So, under
`jit_compile="auto"`:

    xla = tf.function(forward_backward, jit_compile=True)
    graph = xla's trace for these arguments         # traced once either way
    if ops * ops / longest_path > LIMIT and ops / longest_path > WIDE:   # minutes of compile
        run a plain tf.function of forward_backward instead (traced again),
        and say so once
    else:
        run xla

`jit_compile=True` (kmp.prepare's or Keras's compile's) compiles whatever
the cost. The optimizer's update keeps its own XLA computation either way.
"""

from __future__ import annotations

import tensorflow as tf

# autograph=False below: Keras never converts a model's Python (its step is do_not_convert), and
# converting a keras-hub model's call costs seconds of tracing.

# ops * ops / longest path past which a wide forward/backward runs without XLA: above real
# models' and 250 stacked blocks', below 50 parallel branches' (benchmarks/RESULTS.md, P5).
LIMIT = 100_000
WIDE = 4  # ops per step of the longest path: real models' forward/backwards are 2-3

# Ops that do no work: not counted, nor as a step of a path.
_FREE = frozenset({"Const", "Placeholder", "NoOp", "Identity"})


def cost(graph) -> tuple[int, int]:
    """(ops that do work, the longest path of them) in a traced graph.

    A graph lists its ops in the order they were made, so each op's inputs
    come before it.
    """
    depth = {}
    ops = longest = 0
    for op in graph.get_operations():
        d = max([depth.get(t.op.name, 0) for t in op.inputs] + [depth.get(c.name, 0) for c in op.control_inputs],
                default=0)
        if op.type not in _FREE:
            d += 1
            ops += 1
            longest = max(longest, d)
        depth[op.name] = d
    return ops, longest


def too_costly(graph) -> tuple[int, int] | None:
    """(ops, longest path) of a traced graph past LIMIT and WIDE, or None where XLA should compile it."""
    ops, longest = cost(graph)
    width = ops / max(longest, 1)
    return (ops, longest) if ops * width > LIMIT and width > WIDE else None


def plain(fn):
    """`fn` as a tf.function without XLA."""
    return tf.function(fn, reduce_retracing=True, autograph=False)


def function(fn, forced: bool, declined):
    """`fn` as a tf.function compiled with XLA unless its first trace predicts minutes of compile.

    Unless `forced`, the first call's trace is measured; past LIMIT and WIDE,
    `fn` runs as a plain tf.function from then on and `declined(ops, longest)`
    is called once (the caller says so).
    """
    xla = tf.function(fn, jit_compile=True, reduce_retracing=True, autograph=False)
    if forced:
        return xla
    chosen = None

    def call(*args):
        nonlocal chosen
        if chosen is None:
            found = too_costly(xla.get_concrete_function(*args).graph)
            chosen = xla if found is None else plain(fn)
            if found is not None:
                declined(*found)
        return chosen(*args)

    return call
