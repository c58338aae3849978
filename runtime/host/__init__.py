"""Who am I, who writes, who is alive: boot, writer election, stop/host-loss agreement, host logs."""
