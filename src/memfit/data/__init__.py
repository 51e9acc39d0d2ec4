"""Reading and checking training data (the rows every recipe and the planner read)."""
