"""Training tools: draft heads learnt from a target's own features (`specserve train-heads`)."""
