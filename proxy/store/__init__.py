"""Transcript stores: a tree of nodes keyed by chain hash, behind one Protocol."""
