"""One bucket's sync step: the plan compiled into bucket steps, the fused pass, groups."""
