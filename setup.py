"""hethub: DeepSpeed pipeline training across heterogeneous GPU fleets.

Layout: the runtime, CLI, model adapters and emulation helpers live in ``hethub/`` (one sub-package each);
the planner in ``partitioner/`` and the Triton kernels in ``kernels/`` are installed as ``hethub.partitioner``
and ``hethub.kernels`` through ``package_dir`` (no symlinks), so each module has exactly one import name and no
installed top-level name collides with a PyPI package (``kernels``, ``partitioner``). Run from a checkout, the
root is on sys.path; ``kernels/__init__.py`` then hands the top-level name to Hugging Face's ``kernels``
(transformers >= 5.25 imports it, and every build loads its setuptools entry point).
"""
from setuptools import setup

CORE = ["numpy>=1.24", "pulp>=2.8", "highspy>=1.7", "pyyaml>=6", "pydantic>=2.5", "rich>=13"]
RUNTIME = [
    "torch>=2.4",                    # install the CPU wheel first on CPU-only machines (README)
    "deepspeed>=0.19.0,<0.20",       # the plugin overrides engine internals; tested on 0.19.x
    "triton>=3.0; platform_system == 'Linux'",
]
HF = ["transformers>=5.24,<6"]  # hethub.hf: the v5 masking/cache API the block wrappers call
# pytest-xdist: the README runs the suite on three workers (its multi-process tests wait more than they compute)
TEST = ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "setuptools>=70.1", "matplotlib>=3.7", "megatron-core>=0.16,<0.17", *HF]

setup(
    name="hethub",
    version="0.1.0",
    description="Train one model across a heterogeneous GPU fleet on DeepSpeed's pipeline engine",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["hethub", "hethub.cli", "hethub.emulated", "hethub.models", "hethub.runtime",
              "hethub.partitioner", "hethub.partitioner.search", "hethub.kernels"],
    package_dir={"hethub": "hethub", "hethub.partitioner": "partitioner", "hethub.kernels": "kernels"},
    package_data={"hethub": ["py.typed"]},
    install_requires=CORE,
    extras_require={"runtime": RUNTIME, "test": TEST, "hf": HF, "plot": ["matplotlib>=3.7"]},
    entry_points={"console_scripts": ["hethub=hethub.cli:main"]},
)
