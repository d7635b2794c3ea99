"""Model code: ``nn.Module``s, configurations and processing per family (``openvla``, ``openvla_oft``,
``cogact``, ``hybridvla``) on the shared Prismatic VLM (``prismatic``), the shared LLaMA decoder (``llama``)
and diffusion (``diffusion``). No runtime API here: policies and sessions are in ``vla_runtime.policies``.
"""
