"""A ``policy_modules`` plug-in with a bug: importing it raises ``AttributeError`` (configure-failure tests)."""

raise AttributeError("a plug-in's bug: module 'numpy' has no attribute 'flaot'")
