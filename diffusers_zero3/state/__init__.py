"""Training state on disk: checkpoints and resume (on any number of processes), sharded EMA, partitioned load and save, the final pipeline, atomic folders."""
