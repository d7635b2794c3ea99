"""The Prismatic VLM every family here is built on (OpenVLA, OpenVLA-OFT, CogACT, HybridVLA), LeRobot-style
split: ``configuration_vision`` (ViT towers, vision backbone, projector), ``configuration_prismatic``
(``config.json``: ``OpenVLAConfig``, upstream's name), ``modeling_prismatic`` (``PrismaticVLM``: weights and
forward), ``processing_prismatic`` (image transform, token layout types, the pinned prompt, statistics),
``prompt_prismatic`` (the prompt's ids). Nothing is imported here.
"""
