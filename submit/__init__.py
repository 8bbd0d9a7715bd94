"""meshrun's caller side (laptop or login node): plans, renders and submits jobs.

Never imports torch nor the launcher's torch code.
"""
