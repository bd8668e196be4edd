"""The model's own operators, beside model.py: each an optimization with its plain formulation
named in its docstring (README.md lists them)."""
