"""One optimizer step and what happens around it: the loop of micro-steps through the engine, the shards of a batch,
the lr schedule, evaluation, the metrics line and the trackers, the memory profile of the first steps."""
