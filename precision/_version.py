"""The library version, in a module of its own: files the library writes record it, and
the modules writing them must not import the package they are part of."""

__version__ = "0.1.0"
