"""ARPO workbench library."""
