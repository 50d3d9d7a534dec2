"""FlexOlmo (flex_olmo): OLMoE's layout, no shared experts."""
from .registry import MoEArchitecture, register

register(MoEArchitecture("flex_olmo", experts_classes=("FlexOlmoExperts",)))
