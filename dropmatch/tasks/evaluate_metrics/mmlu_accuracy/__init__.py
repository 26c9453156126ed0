"""The `mmlu_accuracy` evaluate metric (the script beside this file)."""
