from setuptools import setup

# The forward pass is a cffi extension (out-of-line API mode) built against the lmserve-core
# kit; the project metadata lives in pyproject.toml.
setup(cffi_modules=["lmserve_qwen35/build.py:ffibuilder"])
