"""`kmp.add_config_arguments(parser)`: kmp's flags on a user's argparse parser, as DeepSpeed's.

    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    kmp.add_config_arguments(parser)
    args = parser.parse_args()
    optimizer = kmp.wrap(keras.optimizers.AdamW(1e-3), args)   # or kmp.wrap(config=args)

DeepSpeed's `deepspeed.add_config_arguments` adds `--deepspeed` and
`--deepspeed_config`; a script moved from DeepSpeed keeps its command
lines, since `--deepspeed_config` is accepted as another name of
`--kmp_config` (and `--deepspeed` is accepted and means nothing more:
giving a config turns kmp's settings on). The other flags fill the
config's "auto" values (kmp.config.auto). Pure Python: no TensorFlow.
"""

from __future__ import annotations

import argparse

# dest -> (flags, argparse keywords); the same names kmp.wrap reads from the namespace.
CONFIG_ARGUMENTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "kmp_config": (("--kmp_config", "--kmp-config", "--deepspeed_config", "--deepspeed-config"),
                   {"metavar": "FILE", "help": "a DeepSpeed-style JSON config (fp16/bf16, optimizer, scheduler, "
                                               "batch sizes, clipping)"}),
    "precision": (("--precision",), {"help": "overrides the config: mixed_float16, mixed_bfloat16, float32, "
                                             "16-mixed, bf16-mixed, auto, ..."}),
    "micro_batch_size": (("--micro_batch_size", "--micro-batch-size"),
                         {"type": int, "metavar": "N", "help": "batch per replica per step (fills 'auto')"}),
    "gradient_accumulation_steps": (("--gradient_accumulation_steps", "--gradient-accumulation-steps"),
                                    {"type": int, "metavar": "N", "help": "micro-batches per optimizer step"}),
    "total_steps": (("--total_steps", "--total-steps"),
                    {"type": int, "metavar": "N", "help": "optimizer steps in the run (fills the scheduler's "
                                                          "'auto' total_num_steps)"}),
    "warmup_steps": (("--warmup_steps", "--warmup-steps"),
                     {"type": int, "metavar": "N", "help": "fills the scheduler's 'auto' warmup_num_steps"}),
    "strict_config": (("--strict_config", "--strict-config"),
                      {"action": "store_true", "help": "unknown config keys are errors, not a warning"}),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add kmp's config and precision flags to `parser` (in a "kmp" group); returns the parser."""
    group = parser.add_argument_group("kmp", "mixed precision and DeepSpeed-style config (kmp)")
    for dest, (flags, keywords) in CONFIG_ARGUMENTS.items():
        group.add_argument(*flags, dest=dest, default=None if dest != "strict_config" else False, **keywords)
    # DeepSpeed scripts pass --deepspeed to switch DeepSpeed on; a kmp config is on when given.
    group.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    return parser
