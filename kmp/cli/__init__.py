"""kmp.cli: the `kmp` command (main.py) and what its subcommands run.

    main.py          argument parsing, one function per subcommand
    env.py           `kmp env`: versions, devices and a quick check
    launch.py        `kmp launch`: one process per worker, TF_CONFIG set
    bench.py         `kmp bench`: the benchmark scripts
    config_check.py  `kmp config check`

The top layer: may import any kmp module, but only inside the subcommand
that needs it, so `kmp --help` imports no TensorFlow. This file imports
nothing.
"""
