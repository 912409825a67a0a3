"""tf-dct: communication-efficient distributed TensorFlow 2 training."""

from setuptools import find_packages, setup

setup(
    name="tf-dct",
    version="0.1.0",
    description=("TF-Replicator strategies with DCT-DP, DCT-MP and DEFT "
                 "gradient/activation compression for TensorFlow 2"),
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["tf_dct", "tf_dct.*"]),
    # C++ source of the optional native kernels, compiled on first use
    # (tf_dct/ops/native.py).
    package_data={"tf_dct.ops": ["kernels/*.cc"]},
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "tf-keras>=2.21,<2.22",
        "keras>=3.10,<4",
        "tensorflow-recommenders==0.7.7",
        "tensorflow-text>=2.21,<2.22",
        "tensorboard>=2.21,<2.22",  # tf.summary.scalar; TF 2.21 no longer depends on it
        "absl-py",
        "numpy",
    ],
    # bench/ studies draw their plots with matplotlib; the tests run tiny
    # versions of them, so the test extra needs it too.
    extras_require={"test": ["pytest", "pytest-xdist", "matplotlib>=3.8"],
                    "bench": ["matplotlib>=3.8"]},
)
