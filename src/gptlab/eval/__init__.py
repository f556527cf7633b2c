"""Evaluations of trained runs: length extrapolation and loss by position (``length``), pictures of the
positional schemes (``positions``)."""
