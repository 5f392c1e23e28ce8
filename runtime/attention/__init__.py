"""Attention backends behind one small interface."""
