from setuptools import find_packages, setup

CONSOLE_SCRIPTS = [
    "ulysses-train = ulysses_train.train.cli:main",  # launch/train.py
    "ulysses-plan = ulysses_train.tools.plan:main",  # python -m ulysses_train.plan
    "ulysses-export = ulysses_train.tools.export:main",  # python -m ulysses_train.export
    "ulysses-preview = ulysses_train.tools.preview:main",  # python -m ulysses_train.preview
]

setup(
    name="ulysses-train",
    version="0.1.0",
    description="Long-context fine-tuning of Hugging Face causal LMs with Ulysses sequence parallelism on DeepSpeed",
    license="Apache-2.0",
    packages=find_packages(include=["ulysses_train", "ulysses_train.*"]),
    # the commands; `deepspeed launch/train.py` (or `deepspeed $(which ulysses-train)`) starts the trainer on GPUs
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
    python_requires=">=3.10",
    # torch is not pinned: bring the build that matches your accelerator (CI installs torch==2.13.0, a CPU build)
    install_requires=["torch>=2.5", "deepspeed>=0.18", "transformers>=5.0", "accelerate>=1.0", "tqdm", "numpy",
                      "tokenizers", "safetensors", "datasets>=3.0",
                      "matplotlib",  # the pictures of --profile_memory and eval_positions
                      # the fused loss on CUDA (--loss_kernel); it needs torch and Triton, whose wheels are Linux's.
                      # Imported only where that loss runs, so the package imports without it
                      "liger-kernel>=0.8.5; platform_system == 'Linux'"],
    extras_require={
        # Triton's interpreter runs our fused kernels on the CPU in the tests (a GPU build of torch brings its own)
        "test": ["pytest>=8", "ruff==0.17.6",  # .ci/run lints with it: one version, the same findings everywhere
                 "tensorboard", "triton; platform_system == 'Linux'", "wandb", "mlflow-skinny",
                 # the preference losses are checked against TRL's trainers' own loss code (internal: one minor)
                 "trl>=1.16,<1.17", "peft>=0.18",
                 "hypothesis>=6.100",  # the probe suite: tests/unit/test_probes.py
                 "pytest-xdist>=3.6"],  # -n 2: two test modules at once fill the cores a launch leaves idle
        "lora": ["peft>=0.18"],  # --use_peft (PEFT's LoRA layers; 0.18 ties modules to save with the embeddings)
        "qlora": ["peft>=0.18", "bitsandbytes"],  # --load_in_4bit (CUDA)
        "track": ["tensorboard", "wandb", "mlflow-skinny"],  # --report_to
        "flash": ["flash-attn"],
        "fa4": ["flash-attn-4"],  # FlashAttention-4 (Hopper, Blackwell): --attn_kernel auto picks it when installed
        # the Gated DeltaNet kernels (--linear_kernel fla); on Hopper with Triton < 3.7.1 FLA's backward needs tilelang
        "fla": ["flash-linear-attention>=0.6", "fla-core>=0.6", "tilelang; platform_system == 'Linux'"],
    },
)
