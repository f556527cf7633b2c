"""Training one model with Lightning: the LightningModule (``module``), optimizers and schedules
(``optimizers``), throughput and MFU (``metrics``), spike detection (``spikes``), the sample and progress-bar
callbacks (``callbacks``), checkpoints that survive kills (``checkpointing``), and muP's coordinate check
(``coord_check``)."""
