"""Sparsity pipeline: profile activations, calibrate thresholds, train predictors, store artifacts."""
from powerinfer_jax.sparsity.artifacts import (SparsityArtifacts, attach_predictors, build_artifacts,
                                               ensure_artifacts, load_artifacts, model_fingerprint)
from powerinfer_jax.sparsity.calibrate import calibrate_thresholds, check_target_sparsity
from powerinfer_jax.sparsity.predictor import Predictor, PredictorStack, TrainConfig, train_predictors
from powerinfer_jax.sparsity.profile import (ActivationProfile, active_masks, collect_ffn_inputs,
                                             plot_frequency, profile_activations)

__all__ = ["ActivationProfile", "Predictor", "PredictorStack", "SparsityArtifacts", "TrainConfig",
           "active_masks", "attach_predictors", "build_artifacts", "calibrate_thresholds",
           "check_target_sparsity", "collect_ffn_inputs", "ensure_artifacts", "load_artifacts",
           "model_fingerprint", "plot_frequency", "profile_activations", "train_predictors"]
