"""docs/config.md's reference of supported keys is generated from kmp's tables and must not drift."""

from kmp.config import reference


def test_docs_config_reference_matches_the_code():
    with open(reference.DOC, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(reference.BEGIN), text.index(reference.END) + len(reference.END)
    assert text[start:end] == reference.reference(), (
        "docs/config.md's reference is out of date: run `python -m kmp.config.reference --write`.")


def test_the_reference_names_every_table_row():
    from kmp.config import auto
    from kmp.config import deepspeed
    from kmp.config import optimizer_block as optimizers
    from kmp.schedules import formulas as schedules

    text = reference.reference()
    for name in ([f"`{row.key}`" for row in deepspeed.DEEPSPEED_KEYS] + [f"`{k}`" for k in optimizers.OPTIMIZERS]
                 + [f"`{k}`" for k in schedules.SCHEDULERS] + [f"`{k}`" for k in auto.FILLS]):
        assert name in text
