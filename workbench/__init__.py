"""Workbench: memory-efficient deep learning techniques, measured on your own hardware."""

__version__ = "0.1.0"
