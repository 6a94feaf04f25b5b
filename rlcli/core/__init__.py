"""The base every part stands on, torch-free but for the batch: config-schema helpers (ranges, errors), registries and
the names they accept, lazy package faces, the one answer extractor, the rollout batch, the job's topology, logger
backends and sweep records (docs/design.md#layers)."""
