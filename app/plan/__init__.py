"""What a model becomes under a memory budget: the budget split, planning, speed prediction."""
