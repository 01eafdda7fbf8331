"""Trace-driven cluster simulator that runs the production policy code."""
