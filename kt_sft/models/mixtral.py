"""Mixtral 8x7B / 8x22B."""
from .registry import MoEArchitecture, register

ARCH = register(MoEArchitecture("mixtral", experts_classes=("MixtralExperts",)))
