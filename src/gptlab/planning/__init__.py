"""Planning a run before it starts: memory per device for a model, strategy and batch (``planner``), and the
model card that prints it with the parameter and FLOP counts (``card``)."""
