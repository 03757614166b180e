"""Operator tools behind the ``sglang-dflash-pp`` console script (``check``).

They run the patched sglang tree's own code for every number and verdict they print (argument
resolution, PP stage build, draft-KV head slicing, the Mooncake registration verdict), so what
they report is what a server of the patched tree would do, not a second model of it.
"""
