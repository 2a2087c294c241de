"""Release control: the promotion gate and the versioned drafter registry."""
