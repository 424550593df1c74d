"""The memory planner (`planner`) and its counts of what each stage allocates (`counts`)."""
