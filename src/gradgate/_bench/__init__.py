"""The pieces of ``gradgate bench``: workloads, methods, measurements, compile, report.

Private: the command line (:mod:`gradgate.bench`) is the public entry point.
"""
