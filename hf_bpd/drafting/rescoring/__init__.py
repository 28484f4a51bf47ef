"""Lattice rescorers (optional): they only change which drafts are verified, never a token."""
