"""Tools for a trained run and its cluster, run from any folder: python tools/generate.py out."""
