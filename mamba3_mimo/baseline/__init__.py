"""The stage-0 baseline of bwd_fwd, kept as the yardstick of the production path."""
