"""What a leak does: the operators' event, the replica's suspension, probe and quarantine, the verdict bounds."""
