"""The `humaneval_pass_at_1` evaluate metric (the script beside this file)."""
