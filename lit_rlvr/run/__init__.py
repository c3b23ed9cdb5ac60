"""Run infrastructure: checkpoints and resume, files that survive a full disk, RNG state, the step timer, the step
log and metrics files, stop requests, collectives and the gathers of FSDP2 shards, the process's warnings and
garbage collection, MFU, run reports, the HTTP client of every server call (http.py)."""
