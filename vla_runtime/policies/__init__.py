"""Policies: the runtime API's contract (``base``), the family table (``registry``) and each family's
policy and episode session (``openvla``, ``cogact``, ``hybridvla`` on the shared ``prismatic_session``).

Nothing is imported here: loading one family never imports another's code.
"""
