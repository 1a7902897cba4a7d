"""The model layer: which files a model is made of, in which graph layout, with which sizes.

``artifacts`` finds them (a ``bgeserve export``, a Hugging Face snapshot, or a pinned hub
download through ``hubfetch``), ``ptload`` reads the ``.pt`` head weights without torch, and
``dims`` reads the encoder sizes the limits and the cost model are sized by. Nothing here
runs a model.
"""
