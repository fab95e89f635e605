"""The built run: the checks of paths and model folders before anything loads, then the trainer that holds the groups,
the data, the model with its levers, the engine and where it resumes."""
