"""Model families. Importing this package registers each family with the runtime API (``load_policy``);
the heavy modules (timm, weights) are imported only when a checkpoint of that family is loaded."""

from ..api import register_family
from .cogact.configuration_cogact import detect_cogact
from .hybridvla.configuration_hybridvla import detect_hybridvla
from .openvla.configuration_openvla import detect_openvla


def _load_openvla(path, **kwargs):
    from .openvla.policy_openvla import load_openvla_policy

    return load_openvla_policy(path, **kwargs)


def _load_cogact(path, **kwargs):
    from .cogact.policy_cogact import load_cogact_policy

    return load_cogact_policy(path, **kwargs)


def _load_hybridvla(path, **kwargs):
    from .hybridvla.policy_hybridvla import load_hybridvla_policy

    return load_hybridvla_policy(path, **kwargs)


register_family("openvla", detect_openvla, _load_openvla)
register_family("cogact", detect_cogact, _load_cogact)
register_family("hybridvla", detect_hybridvla, _load_hybridvla)
