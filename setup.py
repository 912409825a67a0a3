"""Compatibility shim: the package is described in pyproject.toml."""

from setuptools import setup

setup()
