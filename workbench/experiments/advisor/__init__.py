"""The advisor notebook's experiments: a held-out suite of models on which every candidate the advisor
predicts is also run for real (`suite`), the Pareto figure (`plots`) and our targets (`claims`)."""
