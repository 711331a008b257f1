from setuptools import setup

# The shared native kernels are built with cffi (out-of-line API mode); the
# project metadata lives in pyproject.toml.
setup(cffi_modules=["lmserve_core/native/build.py:ffibuilder"])
