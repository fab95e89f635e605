"""Preference training (--method dpo|simpo|orpo): its step and evaluation (the loop's with another objective) and
DPO's reference log-probs."""
