"""`--verify`: one step of the run against plain transformers on the same weights and tokens (for pairs, on whole
sides as TRL takes them), held to the limits transformers' own bf16 error sets."""
