"""Run infrastructure: checkpoints and resume, files that survive a full disk, RNG state, the step log and metrics
files, stop requests, collectives, the process's warnings and garbage collection, MFU, run reports, the HTTP client
of every server call (http.py)."""
