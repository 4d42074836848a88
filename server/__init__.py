"""The EPD daemon: supervisor, engines, backends, configuration and CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("epd")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0+src"
