"""OpenVLA: the Prismatic VLM (``vla_runtime.models.prismatic``) decoding action tokens. What is OpenVLA's own
is ``processing_openvla`` (its step layouts and ``ActionTokenizer``); the runtime API's policy is
``vla_runtime.policies.openvla``. Nothing is imported here.
"""
