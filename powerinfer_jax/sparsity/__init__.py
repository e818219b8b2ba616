"""Sparsity pipeline: modes and selectors, profiling, calibration, predictors, artifacts,
placement. Import the submodule you need (`from powerinfer_jax.sparsity import modes`): the
package itself imports nothing, so `import powerinfer_jax` and config validation stay light."""
