"""Layer 4 — engines: what a device does with an operation.

Every engine has one small interface (see base.py): execute an op on input handles and get
output handles; upload host data; download a handle; sync. Handles are whatever the engine
needs (a native array locally, a tensor id remotely, a graph node in capture).
"""
