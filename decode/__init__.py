"""pdserve decode stage (see DESIGN.md)."""
