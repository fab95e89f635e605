"""The trainer's memory check before the model is built (train/run/memory_check.py): a run the planner's estimate
says does not fit warns with what would fit; one that fits says nothing. The trainer's own path (parse_args, the
resolved DeepSpeed config, run_layout, run_levers, run_estimate) on a planned H100 and H200."""

from ulysses_train.levers.policy import DeviceInfo
from ulysses_train.model.build import load_model_config
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.config.ds_config import resolve_ds_config
from ulysses_train.train.config.ds_file import load_ds_config
from ulysses_train.train.run.memory_check import explicit_flags, memory_warning, run_flags
from ulysses_train.train.run.trainer import run_estimate, run_layout, run_levers

H100_GIB, H200_GIB, HOST_GIB = 79.2, 139.7, 125.0
QWEN35_64K = ["--model_config", "qwen3.5-9b", "--seq_len", "65536", "--offload_activations",
              "--ds_config", "ds_configs/zero3_bf16_states.json"]


def _warning(argv: list[str], gpu_gib: float, host_gib: float = HOST_GIB):
    cfg, explicit = parse_args(argv)
    config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
    ds = resolve_ds_config(load_ds_config(cfg.parallel.ds_config), cfg, explicit, 1, 1, config.hidden_size,
                           use_bf16=True, random_init=True)
    device = DeviceInfo.gpu(gpu_gib, host_gib, local_ranks=1)
    layout = run_layout(cfg, config, 1, "cuda", (9, 0), local_ranks=lambda: 1)
    levers = run_levers(cfg, config, ds, layout, device)
    return memory_warning(run_estimate(cfg, config, ds, layout), levers, device, explicit_flags(cfg, explicit))


def test_a_run_over_the_gpu_warns_with_what_fits():
    """Qwen3.5-9B at 64k with bf16 states: 83.4 GiB by the estimate (82.5 measured on an H200), over an H100's 80 GB
    (where it stopped with CUDA out of memory in its second step): the warning says so. Its fp32 optimizer states
    on the host (150 GiB) fit a 256 GiB host, not a 125 GiB one: the optimizer offload's config is named only
    where it fits."""
    warning = _warning(QWEN35_64K, H100_GIB)
    assert warning is not None
    assert "83.4 GiB per GPU of this GPU's 79.2" in warning and "model states, 67.5 GiB" in warning
    assert "zero3_offload.json" not in warning
    assert "--offload_activations (" not in warning  # already on
    assert ("python -m ulysses_train.plan --gpus N -- --model_config qwen3.5-9b --seq_len 65536 --ds_config "
            "ds_configs/zero3_bf16_states.json --offload_activations`") in warning
    roomy = _warning(QWEN35_64K, H100_GIB, host_gib=256.0)
    assert "--ds_config ds_configs/zero3_offload.json (optimizer states in host memory: 33.4 GiB per GPU" in roomy
    assert _warning(QWEN35_64K, H200_GIB) is None


def test_a_run_that_fits_nowhere_on_one_gpu_names_the_planner_only():
    """Qwen3-8B at 1M tokens on one H100 without the activation offload: neither the optimizer offload nor anything
    else fits it there; the warning names the activation offload and the planner, not the offload config."""
    warning = _warning(["--model_config", "qwen3-8b", "--seq_len", "1048576"], H100_GIB)
    assert warning is not None and "zero3_offload.json" not in warning
    assert "--offload_activations (checkpoints in host memory)" in warning and "ulysses_train.plan" in warning


def test_a_host_over_its_memory_warns_about_the_host():
    """Qwen3.5-9B's fp32 optimizer states offloaded (ds_configs/zero3_offload.json): 150 GiB of host memory by the
    estimate, over a 125 GiB host, while the GPU has room."""
    argv = ["--model_config", "qwen3.5-9b", "--seq_len", "65536", "--ds_config", "ds_configs/zero3_offload.json"]
    warning = _warning(argv, H200_GIB)
    assert warning is not None and "GiB of host memory of this host's 125.0" in warning
    assert "per GPU" not in warning.split(";")[0]


def test_no_warning_off_cuda():
    from ulysses_train.train.run.memory_check import memory_warning as check

    assert check(lambda levers: {}, None, DeviceInfo("cpu", 2**30, 2**30), "") is None


def test_run_flags_leave_the_launchers_local_rank_out():
    assert run_flags(["--local_rank=0", "--seq_len", "4096", "--dataset", "a b.jsonl"]) == \
        "--seq_len 4096 --dataset 'a b.jsonl'"


def test_cuda_out_of_memory_ends_with_what_to_change(capsys):
    """An out-of-memory error that escapes the run (the command line's report of an unexpected error) is followed,
    on the rank that ran out, by the planner command on the run's flags and the flags that lower the peak; other
    errors are not."""
    import torch

    from ulysses_train.train import cli

    for error, hinted in ((torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB"), True),
                          (RuntimeError("something else"), False)):
        try:
            raise error
        except Exception as e:  # noqa: BLE001 - the report reads the exception being handled
            cli._report_unexpected(e, 1, None, "--model_config qwen3-4b --seq_len 65536")
        err = capsys.readouterr().err
        assert err.startswith(f"error: rank 1 failed: {type(error).__name__}")
        assert ("hint: `python -m ulysses_train.plan --gpus N -- --model_config qwen3-4b --seq_len 65536` "
                in err) is hinted
        assert ("--ds_config ds_configs/zero3_offload.json" in err) is hinted


def test_explicit_flags_repeat_what_was_given_from_any_source():
    """The trainer's own flags for the planner command: only those given (not the defaults), as typed on a command
    line, whether they came from argv or the Python API (sys.argv is then the host program's)."""
    from ulysses_train.train.config.train_config import TrainConfig

    cfg, explicit = parse_args(["--model_config", "qwen3-4b", "--seq_len", "4096", "--offload_activations",
                                "--save_final", "false", "--dataset", "my data.jsonl"])
    assert explicit_flags(cfg, explicit) == ("--model_config qwen3-4b --dataset 'my data.jsonl' --seq_len 4096 "
                                             "--offload_activations --save_final false")
    api = TrainConfig.from_flags({"model_config": "qwen3-4b", "seq_len": 8192})
    assert explicit_flags(api, {"model_config", "seq_len"}) == "--model_config qwen3-4b --seq_len 8192"
