"""What the three train_*.py scripts share, one idea a module (README.md lists them)."""
