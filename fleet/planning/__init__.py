"""Planning: the stack file, placement of models onto node pools, and every cost figure."""
