"""Lightning training: target-LM pretraining (lm.py), draft-head training (draft.py), their shared LR schedule
(schedule.py) and job plumbing (trainer.py); the data they train on is :mod:`treedec.data`."""
