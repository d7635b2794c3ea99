"""Policies: the runtime API's contract (``base``), the family table (``registry``) and each family's
policy and episode session (``openvla``, ``openvla_oft``, ``cogact``, ``hybridvla`` on the shared ``prismatic_session``;
``loading``: what every loader settles first).

Nothing is imported here: loading one family never imports another's code.
"""
