"""OpenVLA (Prismatic VLM + action-token head), LeRobot-style split:
``configuration_openvla`` (config.json), ``modeling_openvla`` (weights and forward),
``processing_openvla`` (image, prompt, token layout, actions), ``prompt_openvla`` (the prompt's ids); the
runtime API's policy is ``vla_runtime.policies.openvla``. Nothing is imported here.
"""
