"""The torch side of each PEFT method (launcher_scripts/tuning/ registers them)."""
