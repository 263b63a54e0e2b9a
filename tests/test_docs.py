"""Every code block in README.md, docs/*.md and recipes/README.md does what it says.

One test case per block, named by file and line (`README.md:6`):

- ```python blocks run as written, in this process, each in a fresh
  namespace, from a temporary directory. A name a block uses without
  defining it (`build_model`, `dataset`, ...) comes from PLACEHOLDERS; a
  file it names ("ds_config.json") from FILES. A few blocks are also checked
  for their result (EXPECTATIONS).
- ```json blocks are DeepSpeed-style configs: `kmp.load_config` reads them.
- ```bash / ```sh / untagged blocks are commands. None is run (no pip here);
  each must name what exists: `kmp` subcommands and options (kmp/cli/main.py's
  parser), scripts in the repository and their options (their own parsers),
  the extras in setup.cfg.
- ```text blocks are output or pseudo-code. Output kmp prints is compared
  with what kmp prints now (TEXT_CHECKS); the others are listed in NOT_RUN
  with the reason, so a new block has to be classified here.

The prose is checked too: repository paths and links it names exist, and no
machine path appears.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import configparser
import importlib.util
import json
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmp

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
             "recipes/README.md"]
SHELL = ("", "bash", "sh", "shell", "console")
LANGUAGES = ("python", "json", "text", *SHELL)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")


_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


def read_blocks(path: str) -> list[Block]:
    """The fenced blocks of one Markdown file, dedented (a block may sit in a list item)."""
    lines = (ROOT / path).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: code block never closed")
        code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        found.append(Block(path, i + 1, opening["lang"].lower(), code))
        i = end + 1
    return found


BLOCKS = [block for path in DOC_FILES for block in read_blocks(path)]


def _cases(*languages):
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.lang in languages]


# --- placeholders: what a snippet uses but leaves to the reader --------------


def _build_model():
    """A tiny classifier, 8 features -> 4 classes, ending in a float32 softmax."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = kmp.float32_output(keras.layers.Dense(4)(hidden), "softmax")
    return keras.Model(inputs, outputs)


def _examples():
    """64 unbatched (features, label) pairs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 4, size=64)
    return tf.data.Dataset.from_tensor_slices((x, y))


# Keyed by the name the snippet uses; each value makes it, given the test's
# `request` (for fixtures).
PLACEHOLDERS = {
    "build_model": lambda request: _build_model,  # "your model"
    "dataset": lambda request: _examples().batch(16),  # a batched tf.data pipeline
    "data": lambda request: _examples(),  # an unbatched tf.data.Dataset
    "micro_batch": lambda request: 4,
    # One MirroredStrategy per process (tests/conftest.py says why).
    "strategy": lambda request: request.getfixturevalue("two_replicas"),
}

# Files a snippet names, written to the directory it runs in.
FILES = {
    # An example of ours (not a file from elsewhere).
    "ds_config.json": {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale_window": 1000, "hysteresis": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-5, "warmup_num_steps": 100}},
    },
    # A real Hugging Face template: accelerate's tests/deepspeed/ds_config_zero2.json (the corpus's copy).
    "hf_template.json": json.loads((Path(__file__).parent / "data" / "deepspeed_configs" /
                                    "accelerate__tests__deepspeed__ds_config_zero2.json").read_text()),
}


def _expect_quickstart(ns):
    optimizer = ns["model"].optimizer
    assert isinstance(optimizer, kmp.LossScaleOptimizer)  # mixed_float16 needs loss scaling
    assert int(optimizer.iterations.numpy()) == 4  # 64 examples in batches of 16


def _expect_config_optimizer(ns):
    optimizer = ns["optimizer"]
    assert isinstance(optimizer, kmp.LossScaleOptimizer)  # the file's fp16 block
    assert optimizer.get_config()["hysteresis"] == 2
    assert type(optimizer.inner_optimizer).__name__ == "AdamW"  # the file's optimizer block
    assert optimizer.inner_optimizer.weight_decay == 0.01
    # float32 policy: "auto" fp16/bf16 are off, so no loss scaling; the template's ZeRO stage keeps kmp's optimizer
    # (a static scale of 1) around an AdamW with the template's schedule.
    hf = ns["hf_optimizer"]
    assert isinstance(hf, kmp.LossScaleOptimizer) and hf.zero_stage == 1 and not hf.loss_scale_config.dynamic
    inner = hf.inner_optimizer
    assert type(inner).__name__ == "AdamW" and type(inner._learning_rate).__name__ == "DeepSpeedLearningRate"


def _expect_one_window(ns):
    # 64 examples, 4 per replica on 2 replicas: 8 micro-batches, one window.
    assert int(ns["model"].optimizer.iterations.numpy()) == 1


# A unique piece of a python block -> a check of the namespace it leaves.
EXPECTATIONS = {
    "callbacks=[kmp.callbacks.LossScaleMonitor()]": _expect_quickstart,
    'kmp.wrap(config="ds_config.json")': _expect_config_optimizer,
    "gradient_accumulation_steps=8)": _expect_one_window,
}


def _free_names(tree: ast.AST) -> set[str]:
    """Names read but bound nowhere in the snippet (nor builtins)."""
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
    return read - bound - set(dir(builtins))


@pytest.mark.parametrize("block", _cases("python"))
def test_python_snippet_runs(block, tmp_path, monkeypatch, request):
    tree = ast.parse(block.code, filename=block.id)
    ellipses = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value is Ellipsis]
    assert not ellipses, f"{block.id}: `...` stands for a value on snippet line(s) {ellipses}; write a real one"
    missing = _free_names(tree) - PLACEHOLDERS.keys()
    assert not missing, (
        f"{block.id} uses {sorted(missing)} without defining them: define them in the snippet, "
        "or add placeholders to PLACEHOLDERS in tests/test_docs.py"
    )
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    for name in named & FILES.keys():
        (tmp_path / name).write_text(json.dumps(FILES[name]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TF_CONFIG", raising=False)  # "auto" must mean this one process
    namespace = {"__name__": "__snippet__"}
    namespace.update({name: PLACEHOLDERS[name](request) for name in _free_names(tree)})
    exec(compile(tree, block.id, "exec"), namespace)
    for piece, expect in EXPECTATIONS.items():
        if piece in block.code:
            expect(namespace)


def test_every_expectation_has_its_snippet():
    for piece in EXPECTATIONS:
        holders = [b.id for b in BLOCKS if b.lang == "python" and piece in b.code]
        assert len(holders) == 1, f"EXPECTATIONS key {piece!r} is in python blocks {holders}, not in exactly one"


# --- JSON: DeepSpeed-style configs -------------------------------------------


@pytest.mark.parametrize("block", _cases("json"))
def test_json_config_loads(block):
    raw = json.loads(block.code)
    config = kmp.load_config(raw)  # a ConfigError fails the test; warnings are fine
    assert kmp.load_config(kmp.to_deepspeed(config)) == config


# --- commands ------------------------------------------------------------------


class _Parsed(Exception):
    """Raised instead of running a program once its arguments parsed."""


def _parse_only(main, argv, monkeypatch):
    """Runs `main(argv)` up to its argparse parse_args; argparse errors fail the test."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        main(argv)
    except _Parsed:
        return
    except SystemExit as exit_:
        raise AssertionError(f"arguments {argv} rejected (exit {exit_.code}); see the usage above") from None
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    raise AssertionError(f"{main} returned without parsing arguments")


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _commands(code: str) -> list[list[str]]:
    """Each simple command of a shell block, as argv, split at &&, ||, ;, |."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv = []
        for token in lexer:
            if token in ("&&", "||", ";", "|"):
                out.append(argv)
                argv = []
            else:
                argv.append(token)
        out.append(argv)
    return [argv for argv in out if argv]


def _check_env(assignment: str) -> None:
    name, value = assignment.split("=", 1)
    if name == "TF_CONFIG":
        cluster = json.loads(value)
        assert {"cluster", "task"} <= cluster.keys(), f"TF_CONFIG needs cluster and task: {value}"


def _check_pip(args: list[str]) -> None:
    assert args[:1] == ["install"], f"pip {' '.join(args)}: only `pip install` is expected in the docs"
    extras = _setup_cfg()["options.extras_require"]
    for target in args[1:]:
        match = re.fullmatch(r"\.(?:\[(?P<extras>[\w,-]+)\])?", target)
        assert match, f"pip install {target}: expected . or .[extras] (this repository)"
        assert (ROOT / "setup.cfg").exists() or (ROOT / "pyproject.toml").exists()
        for extra in (match["extras"] or "").split(","):
            assert not extra or extra in extras, f"extra {extra!r} is not in setup.cfg's extras_require"


def _check_kmp(args: list[str], monkeypatch) -> None:
    scripts = _setup_cfg()["options.entry_points"]["console_scripts"]
    assert re.search(r"^\s*kmp\s*=\s*kmp\.cli\.main:main\s*$", scripts, re.M), "setup.cfg has no `kmp` command"
    from kmp.cli import main as cli

    _parse_only(cli.main, args, monkeypatch)


def _check_python(args: list[str], monkeypatch) -> None:
    if args[:2] == ["-m", "pytest"]:
        for arg in args[2:]:
            if not arg.startswith("-"):
                assert (ROOT / arg.split("::")[0]).exists(), f"pytest target {arg} does not exist"
        return
    assert args and args[0].endswith(".py"), f"python {' '.join(args)}: expected a script or -m pytest"
    script = ROOT / args[0]
    assert script.is_file(), f"{args[0]} does not exist"
    spec = importlib.util.spec_from_file_location(f"_doc_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts do their work in main(), not on import
    _parse_only(module.main, args[1:], monkeypatch)


@pytest.mark.parametrize("block", _cases(*SHELL))
def test_shell_commands_name_what_exists(block, monkeypatch):
    commands = _commands(block.code)
    assert commands, f"{block.id}: an untagged block with no command; tag output ```text"
    for argv in commands:
        while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):
            _check_env(argv.pop(0))
        program, args = argv[0], argv[1:]
        if program == "pip":
            _check_pip(args)
        elif program == "kmp":
            _check_kmp(args, monkeypatch)
        elif program in ("python", "python3"):
            _check_python(args, monkeypatch)
        else:
            raise AssertionError(f"{block.id}: unknown command {program!r}; teach tests/test_docs.py to check it")


# --- text: output kmp prints, pseudo-code -----------------------------------------


# A line of TensorFlow's C++ log (glog), which can land in the middle of a tf.print on the same stderr:
# "E0000 00:00:1795941134.342735    5078 util.cc:131] oneDNN supports DT_HALF only on ...".
_NATIVE_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:[\d.]+ +\d+ [\w.]+:\d+\] [^\n]*\n")


def _matches(documented: str, actual: str) -> bool:
    """Equal, with `...` in the documented text standing for any text (TensorFlow's own log lines left out)."""
    pattern = ".*?".join(re.escape(part) for part in documented.strip().split("..."))
    return re.fullmatch(pattern, _NATIVE_LOG.sub("", actual).strip(), re.S) is not None


def _config_error_text(capfd):
    with pytest.raises(kmp.ConfigError) as error:
        kmp.load_config({"fp16": {"enabled": True, "hysterisis": 2}, "gradient_clipping": -1})
    return str(error.value)


def _precision_error_text(capfd):
    with pytest.raises(kmp.ConfigError) as error:
        kmp.resolve_precision("mixed_float61")
    return str(error.value)


def _overflow_lines(capfd):
    layer = keras.layers.Dense(2, use_bias=False, name="dense")
    layer.build((None, 2))
    variable = layer.kernel  # its path: dense/kernel
    inf = [tf.constant([[np.inf, 1.0], [1.0, 1.0]])]
    kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=65536.0).apply(inf, [variable])
    kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=65536.0, hysteresis=2).apply(inf, [variable])
    return capfd.readouterr().err


def _layer_line(capfd):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8, name="d1", kernel_initializer=keras.initializers.Constant(0.25))(inputs)
        h = keras.layers.Dense(8, name="d2", kernel_initializer=keras.initializers.Constant(100.0))(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(h))
        model.compile(optimizer=kmp.wrap(keras.optimizers.SGD(0.01), forward_overflow="backoff"), loss="mse")
        capfd.readouterr()
        kmp.prepare(model).fit(np.full((4, 4), 100.0, "float32"), np.zeros((4, 1), "float32"), verbose=0)
    finally:
        keras.config.set_dtype_policy("float32")
    return capfd.readouterr().err


# The first line of an output block -> what makes that output now.
TEXT_CHECKS = {
    "kmp: gradient overflow, step skipped. Attempted loss scale: 32768 , reducing to 16384 | non-finite gradients: "
    "d1/kernel, d1/bias, d2/kernel, and 3 more | forward overflow in layer 'd2' (Dense): output inf, inputs finite":
        _layer_line,
    "Invalid DeepSpeed config (2 problems):": _config_error_text,
    "Invalid precision setting (1 problem):": _precision_error_text,
    "kmp: gradient overflow, step skipped. Attempted loss scale: 65536 , reducing to 32768 "
    "| non-finite gradients: dense/kernel": _overflow_lines,
}

# The first line of a block that is not checked -> why.
NOT_RUN = {
    "grad = this replica's flat float32 gradient, N*S elements   (forward/backward, XLA; S = ceil(P/N))":
        "pseudo-code of one step at ZeRO stage 1",
    "weights[k] = update(weights[k], g_k, slots)        if finite    (XLA, in place; g_k as above)":
        "pseudo-code of ZeRO stage 1's update and forward pass on replicas of one process",
    "grads  = float32(local gradients) / scale   # unscale first, on each replica":
        "pseudo-code of one optimizer step",
    "on an overflow:                        # the step is always skipped":
        "pseudo-code of kmp/scaling/state.py; the python block after it runs the examples",
    "micro-batch 1..N-1 (each replica, no communication):": "pseudo-code of an accumulation window",
    'grads, finite = the step as with "skip" (all-reduced, checked)': "pseudo-code of kmp/scaling/replay.py",
    "kmp.errors.LossScaleError: kmp: the forward pass overflowed in layer 'gpt2_backbone/transformer_layer_0/"
    "feedforward_intermediate_dense' (Dense, computing in float16): its output was not finite while its inputs were. "
    "No loss scale fixes that (the scale multiplies the loss after the forward pass), so kmp stopped at the first such "
    "step instead of halving the scale to its floor; the step was skipped and the scale stays 32768.":
        "the error of tests/test_forward_overflow.py's GPT-2, which asserts its fix lines (a keras-hub run: too slow here)",
    "kmp: forward overflow in layer 'gpt2_backbone/transformer_layer_0/feedforward_intermediate_dense' (Dense): it "
    "computes in float32 from now on (its weights are float32 already); the step was skipped, the loss scale kept at "
    "32768, and training goes on from the next batch (layers in float32: 1 of at most 8).":
        "the log line of tests/test_forward_overflow.py's GPT-2 run; that file's small model asserts its start",
    "kmp: torch_autocast.lower_precision_safe_modules: 11 layers of gpt2_causal_lm compute in float32 (1 Add, 4 "
    "Dropout, 3 LayerNormalization, 1 PositionEmbedding, 1 ReversibleEmbedding, 1 Softmax); in bfloat16: 2 Dense, 4 "
    "EinsumDense. Weights stay float32.":
        "the log line of tests/test_lower_precision.py's GPT-2 run, which asserts it (a keras-hub run: too slow here)",
    "kmp launch: 2 workers on 127.0.0.1:47945, 127.0.0.1:48689":
        "output of recipes/multiworker.py under kmp launch, two worker processes (tests/test_launch.py runs it)",
}


@pytest.mark.parametrize("block", _cases("text"))
def test_text_output_is_what_kmp_prints(block, capfd):
    if block.first_line in NOT_RUN:
        pytest.skip(NOT_RUN[block.first_line])
    assert block.first_line in TEXT_CHECKS, (
        f"{block.id}: unclassified text block starting {block.first_line!r}: "
        "add it to TEXT_CHECKS (output) or NOT_RUN (with the reason) in tests/test_docs.py"
    )
    actual = TEXT_CHECKS[block.first_line](capfd)
    assert _matches(block.code, actual), f"{block.id} shows:\n{block.code}\nkmp prints:\n{actual}"


# --- the blocks themselves, and the prose ------------------------------------------


def test_every_block_is_checked():
    assert {b.path for b in BLOCKS} == set(DOC_FILES), "a documentation file lost its code blocks (or parsing broke)"
    unknown = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"blocks in a language this file does not check: {unknown}"
    for key in [*TEXT_CHECKS, *NOT_RUN]:
        assert any(b.lang == "text" and b.first_line == key for b in BLOCKS), f"no text block starts {key!r}"


_REPO_PATH = re.compile(r"(?<![\w./-])((?:kmp|tests|benchmarks|recipes|docs)/[\w./-]*\w)")
_LINK = re.compile(r"\]\(([^)\s#]+)")
_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|home|tmp|root|Users|mnt|opt|usr)/|shared/spec")


@pytest.mark.parametrize("path", DOC_FILES)
def test_paths_in_the_prose_exist(path):
    text = (ROOT / path).read_text()
    machine = sorted({m.group(0) for m in _MACHINE_PATH.finditer(text)})
    assert not machine, f"{path} names paths outside the repository: {machine}"
    named = {m.group(1) for m in _REPO_PATH.finditer(text)}
    named |= {
        (ROOT / path).parent.joinpath(link).resolve().relative_to(ROOT).as_posix()
        for link in _LINK.findall(text)
        if "://" not in link
    }
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{path} names paths that do not exist: {missing}"
