"""Evaluations of one trained model, after its training: loss against context length and by position
(``length``), passkey retrieval (``passkey``, ``long_context``), the lm-eval backend (``harness``), and the
figures (``plots``): the studies', and pictures of the positional schemes. Comparing many runs is
:mod:`gptlab.comparison`."""
