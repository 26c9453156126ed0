"""The `gsm8k_exact_match` evaluate metric (the script beside this file)."""
