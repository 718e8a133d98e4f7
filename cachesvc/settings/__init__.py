"""How a launch setting is declared, checked and turned into flags, the docs table and the
values of its group: the machinery under :mod:`cachesvc.settings.config`, which holds the declarations.

``declare`` (a setting: a dataclass field with a :class:`~cachesvc.settings.declare.Setting`),
``rules`` (the value rules), ``speculative`` (``--speculative-config``), ``arguments`` (argparse
flags), ``compose`` (settings by name -> groups), ``table`` (the docs table).
"""
