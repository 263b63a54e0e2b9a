"""kmp.data: input data. The files beside this one are the packaged datasets.

    pipeline.py  input_pipeline: a tf.data pipeline sized by a config's batch settings
    datasets.py  load_digits: a small real dataset shipped inside kmp (numpy only)

May import kmp.config and the leaves. This file imports nothing.
"""
