"""The verifier: runs the original and the rewritten script side by side and compares them.

- ``harness``: the in-process recorder (started through ``boot/sitecustomize.py``);
- ``runner``: starts a run as a subprocess, with timeouts, and reads what it recorded;
- ``compare``: tolerances by what the rewrite does, and the verdict;
- ``report``: the rich table, the JSON and the plot.
"""
