"""`diloco run`: one whole job on this machine.

launch.py starts and supervises every role as a process of its own (procs.py, warm spares in
spare.py, kills in chaos.py); summary.py turns the coordinator's last status, the ledger and the
logs into summary.json. What it shows on the terminal is in diloco.views.
"""
