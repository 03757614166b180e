"""GSM8K C1/C8 benchmark for SGLang servers and routers, with speculative-decoding metrics.

Pure pieces (no server needed): :mod:`.answer` (final-answer parser), :mod:`.data` (GSM8K files,
few-shot prompt, few-shot overlap), :mod:`.metrics` (per-level aggregation and the two acceptance
definitions). :mod:`.client` talks HTTP; :mod:`.report` writes the outputs;
:mod:`.bench_dflash_pd` is the command line.
"""
