"""Knowledge distillation of a draft (GliDe, or the hidden-state draft of specserve/eagle) from the
target's own answers (`training/generation.py`), run as `python -m specserve.training.distill` (cli.py).

One module a job:
- feature_extraction.py: the target's features of every generated answer, one file a generation shard;
- feature_set.py: those files in memory, and the batch of each training step;
- settings.py: what one training run is asked to do;
- starting_draft.py: the draft a run starts from;
- glide_loss.py: the loss of one GliDe step (the hidden-state draft's is `training/eagle.py`'s);
- held_out.py: held-out agreement during a run (`eval-draft`'s answers and metric);
- loop.py: the training loop, with checkpoints that resume exactly;
- run_log.py: what a run writes into its directory, and the plot of its log;
- curve.py: the data-scaling curve over finished runs;
- cli.py: the commands (`features`, `train`, `curve`).
"""
