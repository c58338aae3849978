"""The accelerators jaxjob knows: the catalogue of chips, hosts and slices (catalogue) and each
chip's peak FLOP/s (peaks)."""
