"""The processes of a run: the launcher's environment, signals and injected faults, the watchdog on a stuck
collective, the one report per run, the release of the engine and the process groups at the end."""
