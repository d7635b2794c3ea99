"""OpenVLA (Prismatic VLM + action-token head), LeRobot-style split:
``configuration_openvla`` (config.json), ``modeling_openvla`` (weights and forward),
``processing_openvla`` (image, prompt, token layout, actions), ``policy_openvla`` (runtime API).

Nothing is imported here so that registering the family (``vla_runtime.models``) stays cheap.
"""
