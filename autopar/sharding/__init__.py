"""Layouts: annotations to seed layouts, propagation through per-op rules, redistributions between layouts, gradient flow."""
