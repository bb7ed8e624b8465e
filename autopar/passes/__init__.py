"""Apply a Plan to the traced graph for one rank. Each pass: GraphModule in, GraphModule out."""
