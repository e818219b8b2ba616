"""Synthetic sparse models (random weights, prescribed firing frequencies): for speed only."""
