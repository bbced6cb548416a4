"""Running one model over several ranks with torch.distributed: the layout of ranks, the collectives the
model calls, which slice of each checkpoint tensor a rank holds, and the process groups."""
