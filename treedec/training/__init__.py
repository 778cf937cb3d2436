"""Lightning training: target-LM pretraining (lm.py, data.py) and draft-head training."""
