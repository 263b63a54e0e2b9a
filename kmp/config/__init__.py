"""kmp.config: reading, checking and writing kmp's and DeepSpeed's configuration.

    settings.py         Config, LossScaleConfig, Communication: the settings and their defaults
    optimizer_block.py  the DeepSpeed optimizer block (keras imported only to build one)
    auto.py             DeepSpeed's "auto" values
    zero_block.py       the zero_optimization block's keys and value types (DeepSpeed's)
    autocast_block.py   the torch_autocast and data_types blocks; torch module names -> Keras layer classes
    deepspeed.py        load_config, to_deepspeed, resolve_batch_sizes
    arguments.py        add_config_arguments: the same settings as command-line flags
    reference.py        the generated reference of every key (docs)

Imports no TensorFlow or Keras at module level, only kmp.errors, kmp.values
and kmp.schedules.formulas, so `import kmp`, `kmp config check` and reading a
config stay fast. This file imports nothing.
"""
