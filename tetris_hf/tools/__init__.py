"""The tools around the generation strategy: the ``tetris-hf`` commands (:mod:`.cli`: ``bench``, ``simulate``,
``distill``, ``bound``), model and prompt loading (:mod:`.models`, :mod:`.data`), the Hub export (:mod:`.hub_export`),
the output-agreement metric and the shipped draft (``assets/``).

Tools import the library (``tetris_hf``); the library never imports a tool (``tests/test_layout.py``).
"""
