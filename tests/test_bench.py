"""`kmp bench`: it finds the benchmark scripts and hands each arguments its own parser accepts.

The comparisons themselves take minutes (`kmp bench --quick`: about 4 on 2
cores, 2026-11-24: P1/P2 167 s, P3 20 s, P4 53 s), too long for the suite;
the scripts' arguments are checked here by their own parsers, stopped right
after parsing.
"""

import argparse
import importlib.util
import sys

import pytest

from kmp.cli import bench
from kmp.cli import main as cli
from kmp.errors import KmpError


class _Parsed(Exception):
    pass


def _parse_only(script, argv, monkeypatch):
    sys.path.insert(0, str(script.parent))  # the scripts import their common.py
    spec = importlib.util.spec_from_file_location(f"_bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts do their work in main(), not on import
    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, args=None, namespace=None: (_ for _ in ()).throw(_Parsed(original(self, args))))
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    with pytest.raises(_Parsed):
        module.main()


@pytest.mark.parametrize("comparison", bench.COMPARISONS, ids=[c[1] for c in bench.COMPARISONS])
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_each_script_takes_its_arguments(comparison, quick, monkeypatch):
    _, script, arguments, quick_arguments = comparison
    path = bench.scripts_directory() / script
    assert path.is_file()
    _parse_only(path, quick_arguments if quick else arguments, monkeypatch)


def test_only_must_name_a_comparison():
    with pytest.raises(KmpError, match=r"--only to name one of P1, P2, P3, P4, P6, MEM. Received: 'P9'"):
        bench.run(only="P9")
    assert cli.build_parser().parse_args(["bench", "--quick", "--only", "P4"]).only == "P4"
    assert [c[1] for c in bench.COMPARISONS if "P6" in c[0]] == ["p6_transformer.py"]  # what --only P6 runs
