"""pdserve kvtransfer stage (see DESIGN.md)."""
