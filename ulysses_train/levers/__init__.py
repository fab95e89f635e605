"""The memory and speed levers, and the policy that resolves them (policy.py)."""
