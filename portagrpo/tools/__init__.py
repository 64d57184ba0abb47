"""The user-facing tools beside training: parity, replay, evaluate, export, bench, doctor."""
