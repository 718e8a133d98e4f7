"""The launch configuration and how a launch setting is declared, checked and turned into flags,
the docs table and the values of its group.

``config`` (:class:`~cachesvc.settings.config.ServeConfig`, the flags, ``cli_message``, the docs
table) -> ``groups`` (the five groups: each setting declared once; the ``CACHESVC_*``
environment) and the machinery: ``declare`` (a setting: a dataclass field with a
:class:`~cachesvc.settings.declare.Setting`), ``rules`` (the value rules), ``speculative``
(``--speculative-config``), ``arguments`` (argparse flags), ``compose`` (settings by name ->
groups), ``table`` (the docs table).
"""
