"""Model families. Importing this package registers each family with the runtime API (``load_policy``);
the heavy modules (timm, weights) are imported only when a checkpoint of that family is loaded."""

from ..api import register_family
from .openvla.configuration_openvla import detect_openvla


def _load_openvla(path, **kwargs):
    from .openvla.policy_openvla import load_openvla_policy

    return load_openvla_policy(path, **kwargs)


register_family("openvla", detect_openvla, _load_openvla)
