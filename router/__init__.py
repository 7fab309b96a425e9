"""pdserve router stage (see DESIGN.md)."""
