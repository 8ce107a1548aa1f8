"""The pure-Python reference twin: the spec in plain Python, kept independent of the Cython
sources so that parity tests catch logic bugs as well as compilation bugs."""
