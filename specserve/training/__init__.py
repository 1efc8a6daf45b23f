"""Training one-layer drafts: data from the frozen target with Ray Data, training with Ray Train."""
