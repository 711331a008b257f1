from setuptools import setup

# The forward pass is a cffi extension (out-of-line API mode) compiled together with the
# shared kernels of lmserve-core; the project metadata lives in pyproject.toml.
setup(cffi_modules=["lmserve_inkling/build.py:ffibuilder"])
