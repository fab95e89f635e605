"""The run, in rooms that follow its flow, each importing only the rooms before it (tests/unit/test_architecture.py):

    config/       flags, YAML and DeepSpeed JSON -> one TrainConfig
    process/      the launcher's environment, signals, the watchdog, one report, teardown
    checkpoints/  saves, manifests, the output folder, resume, export
    step/         the loop's optimizer step, evaluation, metrics and trackers
    preference/   the step and evaluation for pairs, DPO's reference log-probs
    run/          the built run (trainer.py): groups, data, model, engine
    verify/       --verify against plain transformers
    api.py, cli.py  the Python API and the command line, on top
"""
