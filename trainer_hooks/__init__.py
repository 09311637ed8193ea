"""In-process hooks of a training rank: step telemetry and checkpoints. The only part of opsd that imports torch."""
