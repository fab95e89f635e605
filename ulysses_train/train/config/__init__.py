"""The flags as one typed TrainConfig: the settings groups, YAML files and the keys of TRL's and axolotl's configs,
the aliases, the DeepSpeed JSON read and reconciled with the flags, each feature's flag checks. Nothing here needs a
model, a process group or a GPU; every other room of train/ reads it."""
