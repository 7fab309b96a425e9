"""pdserve prefill stage (see DESIGN.md)."""
