"""`--verify` on the ranks of a `run_distributed` launch: the helper the verify tests of several files share."""

import os


def verify_settings(rank, world, settings, tmp):
    """Builds a Trainer for each argv of `settings` (with `--verify`, output under `tmp`/<index>) and returns each
    one's `run_verify` result, in order."""
    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.verify.verify import run_verify

    results = []
    for i, argv in enumerate(settings):
        cfg, explicit = parse_args(argv + ["--verify", "--output_dir", os.path.join(tmp, str(i))])
        results.append(run_verify(Trainer(cfg, explicit)))
    return results
