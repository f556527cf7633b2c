"""Evaluations of one trained model, after its training: loss against context length and by position
(``length``), passkey retrieval (``passkey``, ``long_context``), the lm-eval backend (``harness``), pictures of
the positional schemes (``positions``) and the studies' figures (``plots``). Comparing many runs is
:mod:`gptlab.comparison`."""
