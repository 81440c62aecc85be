from setuptools import find_packages, setup

setup(
    name="ringflow",
    version="0.1.0",
    description="Horovod-style distributed training for PyTorch and TensorFlow, in pure Python",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["ringflow", "ringflow.*"]),
    install_requires=["numpy>=1.22", "ml_dtypes>=0.3"],
    extras_require={
        "torch": ["torch"],
        "tensorflow": ["tensorflow-cpu"],
        "mpi": ["mpi4py", "openmpi"],
        "slurm": ["python-hostlist"],
        "gpu": ["cupy-cuda12x"],
        # ringflow.ray.RayExecutor; tested with 2.60 (the core package is enough: no dashboard).
        "ray": ["ray>=2.60,<3"],
        # hvd.init() inside ray.train.torch.TorchTrainer (examples/ray_train_torch.py); tested
        # with 2.60 (Train v2).
        "ray-train": ["ray[train]>=2.60,<3"],
        # hvd.init() under pyspark's TorchDistributor (examples/spark_torch_distributor.py);
        # tested with 4.3 on Java 17 (Spark 4 needs Java 17 or later).
        "spark": ["pyspark>=4.0,<5"],
        # Everything the whole test suite exercises; torch stays pinned by constraints.txt.
        "test": ["pytest", "pytest-timeout", "scikit-learn", "pyyaml", "mpi4py", "openmpi",
                 "torch", "tensorflow-cpu", "cloudpickle", "python-hostlist",
                 "ray[train]>=2.60,<3", "pyspark>=4.0,<5"],
        "examples": ["scikit-learn"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["ringflow-run = ringflow.runner.cli:main"]},
)
