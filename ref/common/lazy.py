"""Packages whose names load on first use, so that importing one costs nothing until a name is used."""

import importlib


def lazy_names(package: str, homes: dict[str, str]):
    """A package's module `__getattr__` that imports a name's home module on first use (`homes`: name -> module)."""
    def getattr_(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(homes[name]), name)
    return getattr_
