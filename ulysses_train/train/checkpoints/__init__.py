"""What a run leaves on disk and starts from: crash-safe checkpoints with their manifests and the free space they
need, the output folder and its lock, where a run resumes, and the export of a checkpoint to a Hugging Face folder."""
