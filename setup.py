"""cffi's out-of-line API-mode build hooks into setuptools through ``cffi_modules``,
which pyproject.toml cannot express; everything else lives in pyproject.toml."""
from setuptools import setup

setup(cffi_modules=["csrc/build_native.py:ffibuilder"])
