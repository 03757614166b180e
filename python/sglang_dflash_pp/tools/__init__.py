"""Operator tools behind the ``sglang-dflash-pp`` console script (``check``, ``preflight``).

They reuse the plugin's own modules for every number they print (ownership rule, carry dtype,
draft-KV geometry and plan, the Mooncake send path), so what they report is what a server
running the plugin would do, not a second model of it.
"""
