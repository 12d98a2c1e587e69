"""Seeing into a plan: tables, HTML, explain, diff, drawings, plots, cost formulas, save/load and the command line."""
