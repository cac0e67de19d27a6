"""The pipeline's stages, one module each, named as `dvc.yaml`, the CLI and `params.yaml` name them:
`target`, `prepare`, `extract`, `train`, `evaluate`, `export`. A stage is `run(params, *, paths…)`:
it orchestrates the packages below it and reads no other file, env var or global.

May import: the shared core, `plan`, `training`, `store`, `serve`, `observe`, `registry`.
"""
