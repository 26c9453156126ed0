"""The `ifeval_accuracy` evaluate metric (the script beside this file)."""
