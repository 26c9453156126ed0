"""The `klue_nli_accuracy` evaluate metric (the script beside this file)."""
