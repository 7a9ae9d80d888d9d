"""Package metadata lives in setup.cfg; this file only enables `pip install -e .`."""
from setuptools import setup

setup()
