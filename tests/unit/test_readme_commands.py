"""Every command in README.md is tested. Each shell command of its code blocks that starts the trainer
(launch/train.py under any launcher, or a SLURM batch script that passes its arguments on) has its flags parsed by the
trainer's own parser, so a renamed flag or a value it does not take fails here; a `python -m ulysses_train.*` tool's
command is parsed by that tool's parser. Each command is then either run here (the planner: arithmetic, in-process),
or run by the test COVERED names, or is one of CI's own commands (.ci/run). The links of README.md and docs/ must
point at pages and headings that exist.

No process is launched here: the trainer's commands are run by the tests COVERED names."""

import ast
import os
import re
import shlex

import pytest

from tests.trainer_runs import COMMON, ROOT, deepspeed_launcher
from ulysses_train.train.config.config_file import config_from, parse_args
from ulysses_train.train.config.train_config import TrainConfig

README = os.path.join(ROOT, "README.md")
TRAINER = "launch/train.py"
MAIN_JOB = "deepspeed --num_gpus 2 launch/train.py --ds_config ds_configs/zero3.json"

# each README command that starts the trainer or a tool -> the test that runs it (or, for what needs GPUs and
# downloads, the test that runs what it turns on, on a tiny model), and why that covers it
COVERED = {
    MAIN_JOB: ("tests/distributed/test_train_e2e.py::"
               "test_sp2_matches_single_process_under_deepspeed_torchrun_and_accelerate",
               "the same launcher and flags (the defaults) with fewer, shorter steps (tests/trainer_runs.py COMMON)"),
    MAIN_JOB + " --verify": ("tests/distributed/test_verify.py::test_verify_command_line",
                             "the same launcher and flags with --verify, at --verify_seq_len 128"),
    "python -m ulysses_train.plan --model_config qwen3-8b --seq_len 1048576 --gpus 8": (
        "tests/unit/test_readme_commands.py::test_the_planner_command_runs", "run here, in-process"),
    "deepspeed --num_gpus 1 launch/train.py --model Qwen/Qwen3-8B --dataset chats.jsonl --seq_len 65536 --use_peft "
    "--lora_r 16 --lora_alpha 32 --steps 500 --lr 1e-4 --save_steps 100": (
        "tests/distributed/test_lora.py::test_lora_under_sp_and_zero3_equals_transformers_and_peft",
        "GPU and download: LoRA on every linear layer, trained through launch/train.py on a tiny model"),
    "deepspeed --num_gpus 8 launch/train.py --ds_config ds_configs/zero3.json --model Qwen/Qwen3-8B --dataset "
    "deepmind/pg19 --seq_len 131072 --sp_size 8 --rope_scaling yarn --steps 100 --lr 1e-5 --save_steps 20": (
        "tests/unit/test_rope.py::test_yarn_on_qwen3_4b_preset_reads_theta_and_length",
        "8 GPUs and downloads: YaRN for 131,072 tokens past Qwen3's 40,960, as this command sets it; SP over a "
        "--model folder is tests/distributed/test_train_e2e.py::test_local_model_folder's"),
    "python3 -m pytest -q -n 2 --dist loadfile -m not slow tests": (
        "tests/unit/test_readme_commands.py::test_the_quick_loop_leaves_out_every_slow_test",
        "collected as README.md says, in a process of its own"),
    "sbatch --nodes 2 --gpus-per-node 8 --time 24:00:00 launch/slurm/train_torchrun.sbatch --model Qwen/Qwen3-8B "
    "--seq_len 1048576 --sp_size 8 --rope_scaling yarn --offload_activations --ds_config "
    "ds_configs/zero3_bf16_states.json --save_steps 10 --steps 1000 --lr 1e-5": (
        "tests/distributed/test_slurm.py::test_batch_script_trains",
        "GPUs: the same batch script, submitted to a local Slurm, trains the tiny default"),
}


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def shell_commands(text: str) -> list[list[str]]:
    """The commands of the bash code blocks, as words: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def _trainer_flags(words: list[str]):
    """The flags a command hands the trainer: after launch/train.py, or after a batch script (which passes them on)."""
    for i, word in enumerate(words):
        if word == TRAINER or word.endswith(".sbatch"):
            return words[i + 1:]
    return None


def _tool(words: list[str]):
    if "-m" in words and words[words.index("-m") + 1].startswith("ulysses_train"):
        return words[words.index("-m") + 1], words[words.index("-m") + 2:]
    return None


def _parse_tool(module: str, args: list[str]) -> None:
    """A tool's command through its own parser, and the trainer flags it takes through the trainer's."""
    if module == "ulysses_train.plan":
        from ulysses_train.tools.plan import _parser

        own, train_argv = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, None)
        _parser().parse_args(own)
        if train_argv is not None:
            parse_args(train_argv)
    elif module == "ulysses_train.preview":
        from ulysses_train.tools.preview import _parser

        parse_args(_parser().parse_known_args(args)[1])
    else:
        pytest.fail(f"README.md runs {module}: teach tests/unit/test_readme_commands.py to parse its flags")


def _ci_commands() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _is_ci_command(words: list[str]) -> bool:
    """`pip install ...` and the test command: .ci/run runs them (pip with its quiet options)."""
    quiet = {"-q", "--disable-pip-version-check"}
    ci = [shlex.split(line, comments=True) for line in _ci_commands()]
    ci = [[w for w in c if w not in quiet] if "pip" in c else c for c in ci]
    if words[0] == "pip":
        words = ["python3", "-m"] + words
    return words in ci


def _launched(words: list[str]) -> str:
    return " ".join(words)


def test_every_readme_command_parses_with_the_parser_it_runs_under():
    commands = shell_commands(_readme())
    assert MAIN_JOB in [_launched(w) for w in commands], "the main job left README.md"
    for words in commands:
        flags, tool = _trainer_flags(words), _tool(words)
        if flags is not None:
            parse_args(flags)  # a ConfigError names the flag
        elif tool is not None:
            _parse_tool(*tool)
        else:  # .ci/run's, or another the COVERED test runs as written (the quick loop)
            assert _is_ci_command(words) or _launched(words) in COVERED, \
                f"README.md's {_launched(words)!r} is neither the trainer, a tool, nor one of .ci/run's commands: " \
                f"test it"


def test_every_readme_command_is_run_by_a_test():
    launched = {_launched(w) for w in shell_commands(_readme()) if not _is_ci_command(w)}
    assert launched - set(COVERED) == set(), "README.md commands no test runs: add them to COVERED with their test"
    assert set(COVERED) - launched == set(), "COVERED names commands README.md no longer has"
    for node, _ in COVERED.values():
        path, name = node.split("::")
        with open(os.path.join(ROOT, path)) as f:
            assert re.search(rf"^def {name}\(", f.read(), re.M), f"{node} does not exist"


def test_the_main_job_is_what_the_end_to_end_test_launches():
    """README's main job is the defaults (its one flag is the default DeepSpeed JSON) under `deepspeed --num_gpus 2`;
    the end-to-end test launches exactly that, with COMMON's fewer and shorter steps."""
    words = shlex.split(MAIN_JOB)
    cfg, _ = parse_args(_trainer_flags(words))
    assert cfg.with_flags(ds_config=os.path.join(ROOT, cfg.parallel.ds_config)) == TrainConfig()  # run from ROOT
    assert deepspeed_launcher(2)[:3] == words[:3]
    path, name = COVERED[MAIN_JOB][0].split("::")
    assert "run(deepspeed_launcher(2), []," in _test_source(path, name)
    assert COMMON[::2] == ["--seq_len", "--steps", "--lr"]  # only lengths and the rate differ from the README's


def _test_source(path: str, name: str) -> str:
    """The source of test function `name` in `path` (read, not imported: test modules are not libraries)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node)


def test_the_test_command_is_cis():
    command = "python3 -m pytest -q -rs -n 2 --dist loadfile tests"
    assert command in _ci_commands()
    assert command.split() in shell_commands(_readme())


def test_the_quick_loop_leaves_out_every_slow_test():
    """README's quick loop (`-m "not slow"`) collects tests/unit's tests but the ones marked slow, and nothing of
    tests/distributed (processes) or tests/gpu (tests/conftest.py marks the folders)."""
    import subprocess
    import sys

    quick = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "not slow", "tests"],
                           capture_output=True, text=True, cwd=ROOT)
    every = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "tests"], capture_output=True,
                           text=True, cwd=ROOT)
    assert quick.returncode == every.returncode == 0, quick.stdout[-2000:] + quick.stderr[-2000:]
    chosen, all_nodes = ({line for line in run.stdout.splitlines() if "::" in line} for run in (quick, every))
    assert chosen and all(node.startswith("tests/unit/") for node in chosen)
    assert "tests/unit/test_readme_commands.py::test_the_quick_loop_leaves_out_every_slow_test" in chosen
    slow = {n for n in all_nodes - chosen if n.startswith("tests/unit/")}
    assert "tests/unit/test_long_range.py::test_positions_beyond_the_trained_length_with_and_without_yarn" in slow
    assert any(n.startswith("tests/distributed/") for n in all_nodes) and any(n.startswith("tests/gpu/")
                                                                             for n in all_nodes)


def test_the_planner_command_runs(capsys):
    from ulysses_train.tools.plan import main

    command = next(c for c in COVERED if c.startswith("python -m ulysses_train.plan"))
    assert main(shlex.split(command)[3:]) == 0
    assert "total (peak)" in capsys.readouterr().out


def test_the_python_api_calls_of_the_readme_take_their_keywords():
    """train(..., name=value) in README.md's Python blocks: each keyword is a flag or one of the field's names."""
    calls = []
    for block in re.findall(r"```python\n(.*?)```", _readme(), re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "train" and node.keywords:
                calls.append({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    assert calls
    for keywords in calls:
        config_from(None, keywords)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return re.sub(r"```.*?```", "", f.read(), flags=re.S)


def test_links_of_the_readme_and_docs_reach_pages_and_headings_that_exist():
    pages = [README] + sorted(os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                              if n.endswith(".md"))
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", _without_code(page)):
            if re.match(r"[a-z]+:", link):
                continue
            target, _, anchor = link.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {link} (no such file)")
            elif anchor and path.endswith(".md"):
                headings = re.findall(r"^#+ (.*)$", _without_code(path), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{os.path.relpath(page, ROOT)}: {link} (no such heading)")
    assert not broken, broken
